"""Asynchronous transfer jobs: many blocks loaded or saved in the background, for engines.

An engine submits a job (a load or a save of many blocks, possibly of several key chains),
goes on computing, and polls or waits for it by job id. A load job can be split by layer
ranges: one Get per range and chain batch, so the engine can wait for the first layers
(``wait_layers``) and compute with them while later layers are still being copied.

This module holds the part both clients share (``TransferPlan``: which RPCs a job sends, and
what their answers mean) and the blocking client's job (``TransferJob``, driven by gRPC
futures and their callbacks, no thread of its own). ``kvtier.client.aio`` drives the same
plan with asyncio tasks.

Invariants:
- A key counts as loaded only when every layer range of the job loaded it; a key whose part
  failed is simply not loaded (the job's ``error`` says why).
- A save job stores each chain in order, one batch after the other, and stops a chain at its
  first ``REJECTED_FULL``: a chain never has a hole that a later batch would fill. A durable
  one reports, beside what the daemon holds, which of those blocks its disk tier wrote
  (``JobStatus.persisted``, from each Put's per-key answer): a block held but not written
  goes on being stored, in memory only.
- ``pages_reusable`` is False once any part ended in a way that leaves the daemon possibly
  still copying (cancelled, deadline exceeded, connection lost, internal error). Then the
  job's pages must not be reused for other blocks: a late copy could write them (load) or
  store what they hold by then (save). Replace the pool instead.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from kvtier.client.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    KvtierError,
    NotFoundError,
    Resends,
    UnavailableError,
    closed_error,
    from_rpc_error,
    refused_stream,
)
from kvtier.client.keys import sequence_len
from kvtier.client.types import (
    PutStatus,
    build_request,
    checked_int,
    checked_seconds,
    checked_type,
    shown,
)
from kvtier.proto import kvtier_pb2 as pb

if TYPE_CHECKING:
    from kvtier.client.aio import AsyncClient
    from kvtier.client.flows import PoolBinding
    from kvtier.client.sync import ChannelStub, Client

# Errors the daemon raises before it touches a pool: a part that ends in one of them leaves
# no copy running.
_CLEAN_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)

_job_ids = itertools.count(1)


class JobKind(enum.Enum):
    LOAD = "load"
    SAVE = "save"


class JobState(enum.Enum):
    RUNNING = "running"
    DONE = "done"  # every part answered
    FAILED = "failed"  # every part ended, at least one with an error
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class LoadSegment:
    """Blocks to load: ``keys[i]`` into ``pages[i]``; ``lease_id`` from a pinning Lookup
    (of any session of this tenant), or 0."""

    keys: Sequence[bytes]
    pages: Sequence[int]
    lease_id: int = 0


@dataclass(frozen=True, slots=True)
class SaveSegment:
    """One key chain to store from ``pages``; ``parent_key`` is the key before ``keys[0]``
    when the chain continues one stored earlier (empty when ``keys[0]`` is a root)."""

    keys: Sequence[bytes]
    pages: Sequence[int]
    parent_key: bytes = b""


@dataclass(frozen=True, slots=True)
class JobStatus:
    """A snapshot of a job. ``done[i]`` is whether key ``i`` (in submission order, segments
    concatenated) is loaded into its page (load jobs: by every layer range) or held by the
    daemon (save jobs: stored now or before)."""

    job_id: int
    kind: JobKind
    state: JobState
    done: np.ndarray
    layers_done: int
    """Load jobs: leading layers whose every part has ended; 0 for saves."""
    error: KvtierError | None
    pages_reusable: bool
    """False while parts are in flight, or when one ended leaving the daemon possibly
    still copying (see the module docstring)."""
    elapsed_s: float
    ended_at: float | None = None
    """The ``time.monotonic()`` instant the job finished; None while it runs."""
    persisted: np.ndarray | None = None
    """Durable save jobs: ``persisted[i]``, whether key ``i``'s block is on the daemon's disk
    tier, as its Put answered (False where the disk tier did not take or write it, and for a
    key not held); None for other jobs."""

    @property
    def finished(self) -> bool:
        return self.state is not JobState.RUNNING

    @property
    def prefix_len(self) -> int:
        """Leading keys done."""
        missing = np.flatnonzero(~self.done)
        return int(missing[0]) if len(missing) else len(self.done)


@dataclass(eq=False, slots=True)
class Part:
    """One RPC of a job."""

    index: int
    method: str
    request: Any
    first_key: int  # position of request.keys[0] among the job's keys
    nkeys: int
    layer_range: int = 0  # load parts: which of the job's layer ranges
    chain: int = 0  # save parts: which segment
    sent: bool = False
    ended: bool = False


def layer_ranges(
    num_layers: int, groups: int | Sequence[tuple[int, int]] | None
) -> list[tuple[int, int]]:
    """Split ``num_layers`` into ``groups`` contiguous ranges (as even as possible), or check
    explicit ranges: they must be non-empty and tile ``[0, num_layers)`` in order
    (InvalidArgumentError otherwise)."""
    if num_layers < 1:
        raise InvalidArgumentError("a pool has at least one layer")
    if groups is None:
        return [(0, num_layers)]
    if isinstance(groups, np.ndarray) and groups.ndim == 2:
        groups = groups.tolist()  # pairs as an (n, 2) array: checked bound by bound below
    if not isinstance(groups, (list, tuple)):  # a count (any integer), or refused by name
        count = min(checked_int(groups, "layer_groups", minimum=1), num_layers)
        bounds = [round(i * num_layers / count) for i in range(count + 1)]
        return [(bounds[i], bounds[i + 1]) for i in range(count)]
    ranges = []
    for i, pair in enumerate(groups):
        # Each bound an integer as given: int() truncated floats and parsed strs.
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidArgumentError(
                f"layer_groups: range {i}: expected a (begin, end) pair, not {shown(pair)}"
            )
        ranges.append(tuple(checked_int(b, f"layer_groups: range {i}") for b in pair))
    expect = 0
    for b, e in ranges:
        if b != expect or e <= b:
            raise InvalidArgumentError(
                f"layer_groups: ranges {shown(ranges)} must tile [0, {num_layers}) in order"
            )
        expect = e
    if expect != num_layers:
        raise InvalidArgumentError(
            f"layer_groups: ranges {shown(ranges)} must tile [0, {num_layers}) in order"
        )
    return ranges  # type: ignore[return-value]


def _segment_len(seg: LoadSegment | SaveSegment, index: int, kind: str) -> int:
    """The number of keys of a segment, which must be of the job's kind and have as many
    pages (a tuple, or the other kind, failed on a missing attribute)."""
    where = f"{kind} segment {index}"
    checked_type(seg, LoadSegment if kind == "load" else SaveSegment, where)
    nkeys = sequence_len(seg.keys, f"{where}: keys")
    npages = sequence_len(seg.pages, f"{where}: pages")
    if nkeys != npages:
        raise InvalidArgumentError(f"{where}: {npages} pages for {nkeys} keys")
    return nkeys


class TransferPlan:
    """The RPCs of one job and the meaning of their answers; sans-IO.

    A driver asks ``take_ready()`` for parts to send, and reports each part's end with
    ``complete`` or ``fail``; ``cancel`` gives up on every part not yet ended. Every request
    is built with the plan, so a bad argument (InvalidArgumentError) stops the job before
    any part is sent.

    Thread-safety: none; the driver serialises calls (the blocking job holds a lock).
    """

    def __init__(
        self,
        kind: JobKind,
        parts: list[Part],
        nkeys: int,
        ranges: list[tuple[int, int]],
        durable: bool = False,
    ) -> None:
        self.job_id = next(_job_ids)
        self.kind = kind
        self.parts = parts
        self.ranges = ranges
        self.started = time.monotonic()
        self.ended_at: float | None = None
        self.error: KvtierError | None = None
        self.cancelled = False
        self.dirty = False  # a part ended leaving a copy possibly running
        self._nkeys = nkeys
        # Load: per layer range, which keys it loaded. Save: row 0, which keys are held.
        self._done = np.zeros((max(1, len(ranges)) if kind is JobKind.LOAD else 1, nkeys), bool)
        # Durable saves: which keys' blocks the disk tier wrote.
        self._persisted = np.zeros(nkeys, bool) if durable else None
        self._pending_per_range = np.zeros(max(1, len(ranges)), dtype=np.int64)
        for p in parts:
            if kind is JobKind.LOAD:
                self._pending_per_range[p.layer_range] += 1
        self._open = len(parts)
        # Save chains run batch after batch: the next part of a chain is released by the
        # previous one's answer.
        self._blocked: dict[int, list[Part]] = {}
        if kind is JobKind.SAVE:
            for p in parts:
                self._blocked.setdefault(p.chain, []).append(p)
            for chain in self._blocked.values():
                chain.reverse()  # pop() from the end gives the next batch
        if not parts:
            self.ended_at = self.started

    # ---------------------------------------------------------------- building

    @classmethod
    def for_load(
        cls,
        segments: Sequence[LoadSegment],
        num_layers: int,
        max_batch: int,
        groups: int | Sequence[tuple[int, int]] | None = None,
    ) -> TransferPlan:
        ranges = layer_ranges(num_layers, groups)
        sequence_len(segments, "segments")
        sizes = [_segment_len(seg, i, "load") for i, seg in enumerate(segments)]
        parts: list[Part] = []
        whole = len(ranges) == 1
        # Range by range, every segment's: parts are sent in this order (``max_calls_open``
        # at a time), so that the first layers of every segment are in first.
        for r, (begin, end) in enumerate(ranges):
            first = 0
            for seg, nkeys in zip(segments, sizes, strict=True):
                for start in range(0, nkeys, max_batch):
                    n = min(max_batch, nkeys - start)
                    req = build_request(
                        pb.GetRequest,
                        keys=seg.keys[start : start + n],
                        pages=seg.pages[start : start + n],
                        lease_id=seg.lease_id,
                        layer_begin=0 if whole else begin,
                        layer_end=0 if whole else end,
                    )
                    parts.append(Part(len(parts), "Get", req, first + start, n, layer_range=r))
                first += nkeys
        return cls(JobKind.LOAD, parts, sum(sizes), ranges)

    @classmethod
    def for_save(
        cls, segments: Sequence[SaveSegment], max_batch: int, durable: bool = False
    ) -> TransferPlan:
        sequence_len(segments, "segments")
        parts: list[Part] = []
        first = 0
        for chain, seg in enumerate(segments):
            nkeys = _segment_len(seg, chain, "save")
            keys, pages = seg.keys, seg.pages
            parent = seg.parent_key
            for start in range(0, nkeys, max_batch):
                n = min(max_batch, nkeys - start)
                req = build_request(
                    pb.PutRequest,
                    keys=keys[start : start + n],
                    pages=pages[start : start + n],
                    parent_key=parent,
                    durable=durable,
                )
                parts.append(Part(len(parts), "Put", req, first + start, n, chain=chain))
                parent = req.keys[-1]
            first += nkeys
        return cls(JobKind.SAVE, parts, first, [], durable)

    # ------------------------------------------------------------------ driving

    @property
    def finished(self) -> bool:
        return self._open == 0

    def take_ready(self) -> list[Part]:
        """Parts to send now (each is returned once)."""
        if self.cancelled:
            return []
        if self.kind is JobKind.LOAD:
            ready = [p for p in self.parts if not p.sent]
        else:
            ready = [chain[-1] for chain in self._blocked.values() if chain and not chain[-1].sent]
        for p in ready:
            p.sent = True
        return ready

    def complete(self, part: Part, response: Any) -> None:
        if part.ended:
            return
        sl = slice(part.first_key, part.first_key + part.nkeys)
        answers = response.loaded if self.kind is JobKind.LOAD else response.results
        if len(answers) != part.nkeys:
            # Not this client's daemon (another version, or not kvtierd): the part ends failed
            # rather than the job's driver dying on the answer and the job never ending.
            self.fail(
                part,
                InternalError(
                    f"{part.method}: the daemon answered {len(answers)} results for "
                    f"{part.nkeys} keys"
                ),
            )
            return
        if self.kind is JobKind.LOAD:
            self._done[part.layer_range, sl] = np.asarray(answers, dtype=bool)
        else:
            statuses = np.asarray(answers, dtype=np.int64)
            held = statuses != int(PutStatus.REJECTED_FULL)
            self._done[0, sl] = held
            if self._persisted is not None and len(response.persisted) == part.nkeys:
                self._persisted[sl] = held & np.asarray(response.persisted, dtype=bool)
            self._take_off_chain(part)
            if not held.all():
                self._close_chain(part.chain)
        self._end(part)

    def fail(self, part: Part, error: KvtierError) -> None:
        if part.ended:
            return
        if self.error is None:
            self.error = error
        if error.code not in _CLEAN_CODES:
            self.dirty = True
        if self.kind is JobKind.SAVE:
            self._take_off_chain(part)
            self._close_chain(part.chain)
        self._end(part)

    def cancel(self) -> list[Part]:
        """Give up on every part not yet ended; returns those that were sent (the driver
        cancels their RPCs). Parts in flight make the pages unsafe to reuse."""
        if self.finished:
            return []
        self.cancelled = True
        in_flight = [p for p in self.parts if p.sent and not p.ended]
        if in_flight:
            self.dirty = True
        for p in self.parts:
            if not p.ended:
                self._end(p)
        return in_flight

    # A signal handler's exception (a KeyboardInterrupt) may land anywhere in ``complete``,
    # before its part has ended; both drivers then ``fail`` the part. So each step that ends
    # a part is done once only, whatever ran of it before: a ``complete`` cut short after its
    # chain's pop had that ``fail`` pop the chain's next batch (or an empty chain:
    # IndexError), and one cut short inside ``_close_chain`` had lost the parts not yet
    # ended there; never ended, they kept the job RUNNING for good.

    def _take_off_chain(self, part: Part) -> None:
        """Take ``part``, its chain's batch in flight, off the chain (once)."""
        chain = self._blocked.get(part.chain)
        if chain and chain[-1] is part:
            chain.pop()

    def _close_chain(self, chain: int) -> None:
        parts = self._blocked.get(chain, [])
        while parts:
            parts[-1].sent = True  # never sent: the chain stopped before it
            self._end(parts[-1])
            parts.pop()
        self._blocked.pop(chain, None)

    def _end(self, part: Part) -> None:
        if part.ended:
            return
        part.ended = True
        self._open -= 1
        if self.kind is JobKind.LOAD:
            self._pending_per_range[part.layer_range] -= 1
        if self._open == 0:
            self.ended_at = time.monotonic()

    # ------------------------------------------------------------------ results

    def layers_done(self) -> int:
        """Leading layers whose every part has ended (loads)."""
        if self.kind is not JobKind.LOAD:
            return 0
        done = 0
        for r, (_, end) in enumerate(self.ranges):
            if self._pending_per_range[r] > 0:
                break
            done = end
        return done

    def layers_ready(self, end_layer: int) -> bool:
        """Whether every part of every layer range that starts below ``end_layer`` ended."""
        for r, (begin, _) in enumerate(self.ranges):
            if begin < end_layer and self._pending_per_range[r] > 0:
                return False
        return True

    def done_mask(self, end_layer: int | None = None) -> np.ndarray:
        """Keys done; for loads, by every layer range starting below ``end_layer`` (all
        ranges when None)."""
        if self.kind is JobKind.LOAD and end_layer is not None:
            rows = [r for r, (begin, _) in enumerate(self.ranges) if begin < end_layer]
            if not rows:
                return np.ones(self._nkeys, dtype=bool)
            return np.asarray(self._done[rows].all(axis=0))
        return np.asarray(self._done.all(axis=0))

    def state(self) -> JobState:
        if self.cancelled:
            return JobState.CANCELLED
        if not self.finished:
            return JobState.RUNNING
        return JobState.FAILED if self.error is not None else JobState.DONE

    def status(self) -> JobStatus:
        end = self.ended_at if self.ended_at is not None else time.monotonic()
        return JobStatus(
            job_id=self.job_id,
            kind=self.kind,
            state=self.state(),
            done=self.done_mask(),
            layers_done=self.layers_done(),
            error=self.error,
            pages_reusable=self.finished and not self.dirty,
            elapsed_s=end - self.started,
            ended_at=self.ended_at,
            persisted=None if self._persisted is None else self._persisted.copy(),
        )


# -------------------------------------------------------------- blocking client


class TransferJob:
    """A job of the blocking ``Client``, running on gRPC futures.

    Thread-safety: any thread may poll, wait or cancel; completions arrive on gRPC's threads.
    """

    def __init__(
        self,
        client: Client,
        binding: PoolBinding,
        plan: TransferPlan,
        timeout_s: float,
        on_finish: Callable[[TransferJob], None] | None = None,
    ) -> None:
        self._client = client
        self._binding = binding
        self._plan = plan
        self._timeout_s = timeout_s
        self._on_finish = on_finish
        self._cond = threading.Condition()
        # Per part in flight: its call's future, and the stub it was sent on.
        self._futures: dict[int, tuple[Any, ChannelStub]] = {}
        # Per part: its time, shared by its sends while the daemon's gRPC refuses it unrun
        # (see ``_resend_later``).
        self._resends: dict[int, Resends] = {}
        self._notified = False

    @property
    def job_id(self) -> int:
        return self._plan.job_id

    @property
    def kind(self) -> JobKind:
        return self._plan.kind

    def start(self) -> TransferJob:
        self._send_ready(may_block=True)
        self._maybe_finish()
        return self

    # ------------------------------------------------------------------ polling

    def poll(self) -> JobStatus:
        with self._cond:
            return self._plan.status()

    def done(self) -> bool:
        with self._cond:
            return self._plan.finished

    def wait(self, timeout_s: float | None = None) -> JobStatus:
        """Wait until every part ended (or ``timeout_s`` passed); returns the status."""
        timeout_s = checked_seconds(timeout_s, "timeout_s", forever=True)
        with self._cond:
            self._cond.wait_for(lambda: self._plan.finished, timeout_s)
            return self._plan.status()

    def wait_layers(self, end_layer: int, timeout_s: float | None = None) -> np.ndarray | None:
        """Wait until layers ``[0, end_layer)`` are complete; returns which keys they loaded,
        or None when ``timeout_s`` passed first (the job goes on)."""
        end_layer = checked_int(end_layer, "end_layer", minimum=0)
        timeout_s = checked_seconds(timeout_s, "timeout_s", forever=True)
        with self._cond:
            if not self._cond.wait_for(lambda: self._plan.layers_ready(end_layer), timeout_s):
                return None
            return self._plan.done_mask(end_layer)

    def cancel(self) -> None:
        """Stop waiting for the job; RPCs in flight are cancelled (see ``pages_reusable``),
        but those on a channel the client gave up, which it cancels itself."""
        with self._cond:
            in_flight = self._plan.cancel()
            stub = self._client.stub
            # Not those on a channel given up meanwhile: their cancel takes the lock an
            # interrupt may have left held there, for good; kept for ``channel_given_up``'s
            # timer, which hands them to the client. The others are dropped, once cancelled
            # here: a later give-up of their channel would read them as still in flight.
            sent = [
                self._futures.pop(p.index)[0]
                for p in in_flight
                if self._futures.get(p.index, (None, None))[1] is stub
            ]
            self._cond.notify_all()
        try:
            for fut in sent:
                fut.cancel()
        except Exception:
            raise
        except BaseException as e:  # a KeyboardInterrupt: gRPC's locks are not safe against it
            self._client.interrupted(e, *sent)
            raise
        self._maybe_finish()

    # ----------------------------------------------------------------- sending

    def _send_ready(self, *, may_block: bool) -> None:
        """Send the parts ready to go (at the start, and as a save's part ends, the next of its
        chain). An interrupt on the way (``_send`` gave the channel up) left those taken to be
        sent and not handed to a slot marked sent, never to end: the job is cancelled
        instead, and so ends (at the start, its caller never got it)."""
        try:
            with self._cond:
                ready = self._plan.take_ready()
            self._send(ready, may_block=may_block)
        except BaseException:
            self.cancel()
            raise

    def _send(self, parts: list[Part], *, may_block: bool = True) -> None:
        """Send ``parts``, each in one of the channel's call slots (``Client.call_slots``):
        those past ``max_calls_open`` queue there, in order, and are sent as slots free,
        on the thread that frees one (``_granted``). Never waits for a slot: this runs on
        gRPC's callback threads too."""
        if not parts:
            return
        try:
            if may_block:
                # Opens the session and registers the pool on first use (blocking, once).
                session_id = self._client.session_id
                pool_id = self._client.pool_id_of(self._binding)
            else:
                # On a gRPC callback thread: never block on an RPC here.
                ids = self._client.live_ids(self._binding)
                if ids is None:
                    raise UnavailableError("the session with the daemon ended during the job")
                session_id, pool_id = ids
        except KvtierError as e:
            for part in parts:
                self._ended(part, None, e)
            return
        # The stub with its channel's slots: a part queued on a channel given up meanwhile
        # fails with its given-up error (``_granted``), never sent on the replacement,
        # whose slots it does not hold.
        stub = self._client.stub
        try:
            for part in parts:
                part.request.session_id = session_id
                part.request.pool_id = pool_id
                if stub.call_slots.take_or_queue(functools.partial(self._granted, part, stub)):
                    self._granted(part, stub)
        except Exception:
            raise
        except BaseException as e:  # as ``Client._until_run``: the slot goes with the channel
            self._client.interrupted(e)
            raise

    def _granted(self, part: Part, stub: ChannelStub) -> None:
        """A part has a slot (taken at once, or come free as it queued): send it, or free the
        slot again when the part ended meanwhile (the job was cancelled), or when its channel
        was given up meanwhile (its slots with it, ``CallSlots.give_up``):
        then it fails as one the channel's close keeps from being sent, without touching the
        channel, whose lock the interrupt may have left held (a send would wait on it for
        good)."""
        with self._cond:
            gone = self._plan.cancelled or part.ended
        given_up = None if gone else self._client.given_up(stub, part.request.session_id)
        if gone or given_up is not None:
            stub.call_slots.release()
            if given_up is not None:
                self._ended(part, None, given_up)
        else:
            self._send_one(part, stub)

    def _send_one(self, part: Part, stub: ChannelStub) -> None:
        """Send a part on ``stub`` holding one of its channel's call slots; its done callback
        frees the slot."""
        slots = stub.call_slots
        resends = self._resends.setdefault(part.index, Resends(self._timeout_s))
        try:
            fut = getattr(stub, part.method).future(part.request, timeout=resends.left_s())
        except ValueError:  # closed (or given up) meanwhile: its channel sends nothing
            slots.release()
            error = self._client.given_up(stub, part.request.session_id) or closed_error()
            self._ended(part, None, error)
            return
        except Exception as e:  # on a callback thread nobody would see it
            slots.release()
            self._ended(part, None, _client_side_error(part, e))
            return
        except BaseException as e:  # a KeyboardInterrupt in the caller's thread
            self._client.interrupted(e, holding=slots)
            self._send_interrupted(part, stub)
            raise
        with self._cond:
            self._futures[part.index] = (fut, stub)
        try:
            # Under the call's lock, which the answer's delivery takes: guarded as the
            # call's start.
            fut.add_done_callback(lambda f, part=part, stub=stub: self._on_done(part, f, stub))
        except Exception:
            raise
        except BaseException as e:
            self._client.interrupted(e, fut)
            self._send_interrupted(part, stub)
            raise

    def channel_given_up(
        self, stub: ChannelStub, keep: Callable[..., None], grace_s: float
    ) -> None:
        """Bound the wait of the parts in flight on ``stub``, whose channel the client gave up
        after an interrupt (``Client._replace_if_suspect``), as a pinning Lookup's is: its
        close ends them (``_on_done``), or their deadline does; but where the interrupt left
        gRPC's lock held there, neither comes, and the job stayed RUNNING for good. Those
        still unanswered ``grace_s`` past the last one's deadline fail then (``_unanswered``).
        """
        with self._cond:
            sent = {i: fut for i, (fut, on) in self._futures.items() if on is stub}
        if not sent:
            return
        wait_s = max(self._resends[i].left_s() for i in sent) + grace_s
        timer = threading.Timer(wait_s, self._unanswered, args=(sent, keep, grace_s))
        timer.daemon = True
        timer.start()

    def _unanswered(self, sent: dict[int, Any], keep: Callable[..., None], grace_s: float) -> None:
        """End the parts of ``sent`` (their calls on a given-up channel) still unanswered, as
        a deadline does (pages not reusable). Their calls go to ``keep`` first, which cancels
        them on a thread of its own and holds them: a call's cancel, and its collection as
        ``_ended`` drops it, take the lock an interrupt may have left held."""
        with self._cond:
            unanswered = {i: f for i, f in sent.items() if self._futures.get(i, (None,))[0] is f}
        if not unanswered:
            return
        keep(*unanswered.values())
        for index in unanswered:
            part = self._plan.parts[index]
            error = DeadlineExceededError(
                f"{part.method}: no answer, nor gRPC's deadline, within {self._timeout_s}s "
                f"and {grace_s}s more (its channel was given up with gRPC's lock held: see "
                "Client.interrupted)"
            )
            self._ended(part, None, error)

    def _send_interrupted(self, part: Part, stub: ChannelStub) -> None:
        """End a part whose send an interrupt ended on this thread (the channel given up):
        never to be answered here (its done callback perhaps not taken, or the call's cancel
        read in ``_on_done`` as the job's), it fails as the calls the given-up channel's
        close ends, its call perhaps begun in gRPC, so its pages are not reusable."""
        with self._cond:
            self._plan.dirty = True
        error = self._client.given_up(stub, part.request.session_id) or closed_error()
        self._ended(part, None, error)

    def _on_done(self, part: Part, fut: Any, stub: ChannelStub) -> None:
        stub.call_slots.release()  # a queued part may go out first, on this thread
        if fut.cancelled():
            return  # cancel() already ended the part
        try:
            response = fut.result()
        except grpc.RpcError as e:
            # A channel another thread's interrupt gave up: its close ended the call
            # (CANCELLED), and its session with the part's lease and pool id. Any other
            # status is the call's own (a DEADLINE_EXCEEDED one's copy may still run).
            cancelled = e.code() == grpc.StatusCode.CANCELLED
            if cancelled and (given_up := self._client.given_up(stub, part.request.session_id)):
                # Sent, and ended on our side only: the daemon may still be copying its
                # pages, as after a lost connection (the error itself reads as answered).
                with self._cond:
                    self._plan.dirty = True
                self._ended(part, None, given_up)
            elif not (refused_stream(e) and self._resend_later(part)):
                self._ended(part, None, self._client.error_of(e))
        except Exception as e:  # not a gRPC status: the job must still end
            self._ended(part, None, _client_side_error(part, e))
        else:
            self._ended(part, response, None)

    def _resend_later(self, part: Part) -> bool:
        """Send a part the daemon's gRPC refused unrun again after a pause, as the client's
        own calls are (``Client.call``): a load job sends all its parts at once, past the
        daemon's calls per connection once it has a few hundred. False when the part's time
        would end first, or the job was cancelled. On a gRPC callback thread: never sleeps."""
        with self._cond:
            if self._plan.cancelled or part.ended:
                return False
            if (pause := self._resends[part.index].pause_s()) is None:
                return False
            self._futures.pop(part.index, None)
        timer = threading.Timer(pause, self._resend, args=(part,))
        timer.daemon = True
        timer.start()
        return True

    def _resend(self, part: Part) -> None:
        with self._cond:
            if self._plan.cancelled or part.ended:
                return
        self._send([part], may_block=False)

    def _ended(self, part: Part, response: Any, error: KvtierError | None) -> None:
        if isinstance(error, NotFoundError):
            # The daemon lost our session or pool (it restarted, or ended the session at a
            # reload): register again, in a new session if so, next time.
            if error.session_gone:
                self._client.forget_session(part.request.session_id)
            self._client.forget_pool_id(self._binding, part.request.pool_id)
        with self._cond:
            if error is None:
                self._plan.complete(part, response)
            else:
                self._plan.fail(part, error)
            self._futures.pop(part.index, None)
            self._cond.notify_all()
        self._send_ready(may_block=False)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        with self._cond:
            if not self._plan.finished or self._notified:
                return
            self._notified = True
        if self._on_finish is not None:
            self._on_finish(self)


def _client_side_error(part: Part, error: BaseException) -> InternalError:
    """A part's RPC that raised something other than a gRPC status (a request that did not
    encode, an answer that did not decode, a signal handler's exception in the asyncio
    client's loop): the part fails with it, so the job ends."""
    return InternalError(f"{part.method} failed in the client: {error!r}")


# --------------------------------------------------------------- asyncio client


class AsyncTransferJob:
    """A job of the ``AsyncClient``: one task per RPC in flight, on the client's loop.

    Thread-safety: use from the client's event loop only.
    """

    def __init__(
        self,
        client: AsyncClient,
        binding: PoolBinding,
        plan: TransferPlan,
        timeout_s: float,
        on_finish: Callable[[AsyncTransferJob], None] | None = None,
    ) -> None:
        self._client = client
        self._binding = binding
        self._plan = plan
        self._timeout_s = timeout_s
        self._on_finish = on_finish
        self._changed = asyncio.Condition()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._notified = False

    @property
    def job_id(self) -> int:
        return self._plan.job_id

    @property
    def kind(self) -> JobKind:
        return self._plan.kind

    async def start(self) -> AsyncTransferJob:
        await self._send_ready()
        await self._maybe_finish()
        return self

    def poll(self) -> JobStatus:
        return self._plan.status()

    def done(self) -> bool:
        return self._plan.finished

    async def wait(self, timeout_s: float | None = None) -> JobStatus:
        """Wait until every part ended (or ``timeout_s`` passed); returns the status."""
        timeout_s = checked_seconds(timeout_s, "timeout_s", forever=True)
        await self._wait_for(lambda: self._plan.finished, timeout_s)
        return self._plan.status()

    async def wait_layers(
        self, end_layer: int, timeout_s: float | None = None
    ) -> np.ndarray | None:
        """See ``TransferJob.wait_layers``."""
        end_layer = checked_int(end_layer, "end_layer", minimum=0)
        timeout_s = checked_seconds(timeout_s, "timeout_s", forever=True)
        if not await self._wait_for(lambda: self._plan.layers_ready(end_layer), timeout_s):
            return None
        return self._plan.done_mask(end_layer)

    async def cancel(self) -> None:
        """See ``TransferJob.cancel``."""
        for part in self._plan.cancel():
            task = self._tasks.pop(part.index, None)
            if task is not None:
                task.cancel()
        async with self._changed:
            self._changed.notify_all()
        await self._maybe_finish()

    async def _wait_for(self, predicate: Callable[[], bool], timeout_s: float | None) -> bool:
        async def waiter() -> None:
            async with self._changed:
                await self._changed.wait_for(predicate)

        try:
            await asyncio.wait_for(waiter(), timeout_s)
        except asyncio.TimeoutError:
            return predicate()
        return True

    async def _send_ready(self) -> None:
        """See ``TransferJob._send_ready`` (a cancel that ends the send, as well)."""
        try:
            await self._send(self._plan.take_ready())
        except BaseException:
            await self.cancel()
            raise

    async def _send(self, parts: list[Part]) -> None:
        if not parts:
            return
        try:
            session_id = await self._client.session()
            pool_id = await self._client.pool_id_of(self._binding)
        except KvtierError as e:
            for part in parts:
                await self._ended(part, None, e)
            return
        for part in parts:
            part.request.session_id = session_id
            part.request.pool_id = pool_id
            task = asyncio.create_task(self._run(part))
            task.add_done_callback(functools.partial(self._run_ended, part))
            self._tasks[part.index] = task

    def _run_ended(self, part: Part, task: asyncio.Task[None]) -> None:
        """The end of a part's task (a done callback): a part still open there ended by what
        a signal's handler raised as the task took its first step, at the entry of ``_run``,
        before its try (where the interpreter first checks for signals in it), which kept
        the job RUNNING for good. It fails as ``_run`` fails one (a client-side error), on a
        task of its own: ``_ended`` awaits. Not for a cancel (the job's ends its parts
        first; the loop's own at its end has no later step to run that task)."""
        if part.ended or task.cancelled():
            return
        error = task.exception()
        if error is not None:  # held as the part's task, which ``_ended`` drops
            ending = self._ended(part, None, _client_side_error(part, error))
            self._tasks[part.index] = asyncio.ensure_future(ending)

    async def _run(self, part: Part) -> None:
        try:
            # Through the client's own call: a part refused unrun is sent again (the job
            # sends all its parts at once, past the daemon's calls per connection).
            response = await self._client.call(
                part.method, part.request, self._timeout_s, timed_wait=False
            )
            # In the try: an exception that lands as the answer is taken in, before the part
            # ends, ends it as one in the call does (once ended, the part stays as it ended).
            await self._ended(part, response, None)
        except grpc.RpcError as e:
            await self._ended(part, None, from_rpc_error(e))
        except grpc.aio.UsageError:  # the client was closed meanwhile: its channel sends nothing
            await self._ended(part, None, closed_error())
        except asyncio.CancelledError as e:  # the job's cancel, or the client's close() ending it
            if (closed := self._client.closed_error_for(e)) is None:
                raise
            await self._ended(part, None, closed)
        except Exception as e:  # not a gRPC status: the job must still end
            await self._ended(part, None, _client_side_error(part, e))
        except GeneratorExit:  # the task's coroutine closed unfinished: it may not await
            raise
        except BaseException as e:
            # What a signal's handler raised in the loop (a KeyboardInterrupt under a loop
            # run without ``asyncio.run``'s handler, as a notebook's): it ends this task, and
            # the part, never ended, kept the job RUNNING for good. It fails as a client-side
            # error (its call perhaps begun: pages not reusable), as the blocking client's
            # interrupted parts do (``TransferJob._send_interrupted``).
            await self._ended(part, None, _client_side_error(part, e))
            raise

    async def _ended(self, part: Part, response: Any, error: KvtierError | None) -> None:
        if isinstance(error, NotFoundError):
            if error.session_gone:
                self._client.forget_session(part.request.session_id)
            self._client.forget_pool_id(self._binding, part.request.pool_id)
        if error is None:
            self._plan.complete(part, response)
        else:
            self._plan.fail(part, error)
        self._tasks.pop(part.index, None)
        async with self._changed:
            self._changed.notify_all()
        await self._send_ready()
        await self._maybe_finish()

    async def _maybe_finish(self) -> None:
        if not self._plan.finished or self._notified:
            return
        self._notified = True
        if self._on_finish is not None:
            self._on_finish(self)


@dataclass
class JobTable:
    """Jobs by id, as both clients keep them. A running job stays; a finished one stays
    until the client's ``wait`` or ``cancel`` hands out its final status, or until
    ``keep_finished`` newer jobs have finished (so engines that hold job objects and never
    ask by id leak nothing).

    Thread-safety: thread-safe."""

    keep_finished: int = 4096
    jobs: dict[int, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _finished: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def add(self, job: Any) -> None:
        with self.lock:
            self.jobs[job.job_id] = job

    def finished(self, job_id: int) -> None:
        with self.lock:
            if job_id not in self.jobs:
                return
            self._finished[job_id] = None
            while len(self._finished) > self.keep_finished:
                old, _ = self._finished.popitem(last=False)
                self.jobs.pop(old, None)

    def get(self, job_id: int) -> Any:
        job_id = checked_int(job_id, "job_id")
        with self.lock:
            job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError(
                f"no job {shown(job_id)} (never submitted, or its result was taken)"
            )
        return job

    def forget(self, job_id: int) -> None:
        with self.lock:
            self.jobs.pop(job_id, None)
            self._finished.pop(job_id, None)

    def __len__(self) -> int:
        with self.lock:
            return len(self.jobs)
