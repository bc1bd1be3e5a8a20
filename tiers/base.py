"""What every tier is: a medium that holds block bytes. No policy lives here.

A tier never decides what to keep. The store reserves slots, asks tiers to move batches of
blocks between their media and a *buffer* (host memory, or a registered engine pool's pages),
and removes blocks; the policies decide which. Tier kinds match the wire enum
``kvtier.v1.Tier`` and order the tier stack, fastest first: L0 GPU, L1 host, L2 disk, L3 remote.

Two shapes of tier share the vocabulary of this module:

- **Slot tiers** (``SlotTier``: L0, L1, L2, the in-memory test tier) own their space. The store
  allocates a slot from the tier's ``allocator`` for every block it places there and keeps the
  slot in its block table. Their data verbs (``write``, ``read``, ``remove``) block and run on
  worker threads; two calls in flight never name the same slot (the store's in-flight marks
  guarantee it).
- **Key-addressed tiers** (``KeyTier``: L3 on a remote store) keep their own index. The store
  names blocks by ``(namespace, key)``; presence is answered by an asynchronous batch probe
  that returns the size of each block of the present prefix of a chain. Their verbs are
  coroutines on the daemon's event loop and never block it.

Faults are results, never exceptions out of a data verb: a failed read is a miss (the block's
bytes never reach the buffer's owner as valid data), a failed write is an outcome with
``ok=False``, and the tier reports its state through ``health()``. Exceptions are kept for
programming errors (a slot that is not allocated, a buffer too short).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias

import numpy as np
import xxhash

from kvtier.kernels.layout import ChunkTable
from kvtier.kernels.runs import SegmentMap
from kvtier.tiers.slab import SlabAllocator

if TYPE_CHECKING:
    from kvtier.tiers.executor import Urgency


class TierKind(enum.IntEnum):
    """A tier's place in the stack (the wire enum ``kvtier.v1.Tier``); lower is faster."""

    GPU = 1
    HOST = 2
    DISK = 3
    REMOTE = 4

    @property
    def label(self) -> str:
        return _LABELS[self]

    @classmethod
    def from_label(cls, label: str) -> TierKind:
        for kind, name in _LABELS.items():
            if name == label.upper():
                return kind
        raise ValueError(f"unknown tier {label!r}; one of {', '.join(_LABELS.values())}")


_LABELS = {TierKind.GPU: "L0", TierKind.HOST: "L1", TierKind.DISK: "L2", TierKind.REMOTE: "L3"}


class Priority(enum.IntEnum):
    """How urgent a transfer is; lower goes first, down to the threads that move bytes.

    Within a class, a transfer also has a rank (an int, 0 by default): a higher rank goes
    first among the waiting transfers of its class, equal ranks in the order they came. Only
    prefetches are ranked (the engine's ``Prefetch.priority``); no rank moves a transfer
    ahead of a more urgent class or behind a less urgent one. A move that a more urgent
    caller waits for is raised to that caller's class and rank (``executor.Urgency``)."""

    DEMAND = 0  # a request waits on it
    PREFETCH = 1  # ahead of use
    BACKGROUND = 2  # demotion, write-back, write-through, removal


class Health(enum.Enum):
    OK = "ok"
    DEGRADED_NOSPACE = "degraded_nospace"  # full: refuses writes, serves reads, may recover
    DEGRADED_IO = "degraded_io"  # I/O faults: refuses writes, serves reads
    DOWN = "down"  # serves nothing (a remote store that cannot be reached)


@dataclass(frozen=True, slots=True)
class TierHealth:
    state: Health = Health.OK
    detail: str = ""
    # Degraded by a fault that may pass (a full disk), the tier lets a write through now to
    # find out; nothing else tells it the fault passed.
    retry_due: bool = False
    # The state holds for a part of the tier only (a cluster's master): the rest serves and
    # takes writes as an OK tier does, and the tier declines, itself, what the part cannot.
    partial: bool = False

    @property
    def accepts_writes(self) -> bool:
        return self.state is Health.OK or (self.partial and self.state is not Health.DOWN)

    @property
    def takes_writes(self) -> bool:
        """Whether a write sent now is tried: the tier accepts writes, or is due to let one
        through to see whether its fault passed (``retry_due``)."""
        return self.accepts_writes or self.retry_due

    @property
    def serves_reads(self) -> bool:
        return self.state is not Health.DOWN

    def __str__(self) -> str:
        return self.state.value + (f": {self.detail}" if self.detail else "")


HEALTHY = TierHealth()

# What a key-addressed tier's ``probe_each`` answers for a block it does not hold (the store
# said so), and for one it could not ask about (late, unreachable, a command's error): the
# first may drop a copy the node remembers, the second must change nothing.
PROBE_ABSENT = -1
PROBE_UNKNOWN = -2


def leading_sizes(answers: Sequence[int]) -> list[int]:
    """The sizes of the present prefix of a ``probe_each`` answer (``probe``'s answer)."""
    n = next((i for i, size in enumerate(answers) if size < 0), len(answers))
    return list(answers[:n])


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot. ``counters`` only grow (names without a tier prefix, e.g. ``blocks_read``);
    ``gauges`` are point-in-time values."""

    kind: TierKind
    health: TierHealth
    capacity_bytes: int
    used_bytes: int
    counters: Mapping[str, int] = field(default_factory=dict)
    gauges: Mapping[str, float] = field(default_factory=dict)


class TierError(Exception):
    """A tier could not move bytes (I/O error, corrupt data). Callers treat it as a miss."""


class TierUnavailable(TierError):
    """A tier cannot start: its medium cannot hold the configured capacity, or is in use by
    another process. Raised only by a tier's constructor; the daemon reports it and stops
    rather than running without the tier it was configured with."""


class TierMemoryExhausted(TierError):
    """A tier could not allocate the working memory one transfer needs (the GPU tier's
    scratch on a device the engine fills): that transfer fails, while the tier, its blocks
    and the transfers after it are unaffected. Raised by the ``DeviceBridge`` verbs."""


# ---------------------------------------------------------------------------- buffers


@dataclass(frozen=True, slots=True)
class HostBuffers:
    """One contiguous host buffer per block of a batch (L1 slot views, staging buffers).
    Each is at least the block's length; a page-aligned buffer of the slot's size lets a disk
    tier transfer it without staging."""

    views: Sequence[memoryview]
    addresses: Sequence[int] | None = None
    """Each view's address, when its maker knows them cheaply (an arena's slots: base plus
    offset); a disk tier then finds the page-aligned ones without asking each view."""

    def __len__(self) -> int:
        return len(self.views)


@dataclass(frozen=True, slots=True)
class PoolPages:
    """Pages of a registered engine pool: block ``j`` of a batch is gathered from (or
    scattered into) the chunks of ``pages[j]`` as ``table`` lays them out."""

    table: ChunkTable
    memory: np.ndarray  # the pool's mapping as uint8
    pages: np.ndarray  # int64, one per block
    threads: int = 1

    def __len__(self) -> int:
        return len(self.pages)


@dataclass(frozen=True, slots=True)
class DevicePages:
    """Pages of a registered engine pool in GPU memory (CUDA IPC): block ``j`` of a batch is
    gathered from (or scattered into) the chunks of ``pages[j]``, which ``segments`` (one
    1-D uint8 device tensor per buffer) hold as ``smap`` lays them out. Only the GPU tier
    (``tiers/device.py``) moves bytes in and out of these."""

    smap: SegmentMap
    segments: Sequence[Any]  # torch.Tensor; tiers/base.py imports no torch
    pages: np.ndarray  # int64, one per block

    def __len__(self) -> int:
        return len(self.pages)


Buffers: TypeAlias = "HostBuffers | PoolPages | DevicePages"


class BlockRef(NamedTuple):
    """A block's identity as a tier may need it: for an index that survives restarts, for
    logs, and as the address in a key-addressed tier. A named tuple: a batch makes one per
    block, and a tuple is several times cheaper to build than a frozen dataclass."""

    ns: int
    key: bytes


class BlockRefs(Sequence[BlockRef]):
    """The identities of a batch's blocks as two arrays (namespace ids, key bytes), read as a
    sequence of ``BlockRef``: a tier that wants the columns (the disk tier's index rows)
    takes them whole, one that never looks (a host arena) costs nothing per block, and one
    that goes block by block gets a ``BlockRef`` each as it asks."""

    __slots__ = ("keys", "ns")

    def __init__(self, ns: np.ndarray, keys: np.ndarray) -> None:
        self.ns = np.asarray(ns, dtype=np.uint64)  # (n,)
        keys = np.ascontiguousarray(keys)
        if len(keys) != len(self.ns):
            raise ValueError(f"{len(self.ns)} namespaces but {len(keys)} keys")
        # (n, key bytes) whatever the caller's dtype (the table's uint64 words, fixed-width
        # bytes): a row is then its whole key, also where a bytes scalar would drop the
        # trailing zeros. (math.prod: np.prod of the shape, a tuple, costs ~8 us, at every Get
        # and Put of more than one block.)
        width = keys.itemsize * math.prod(keys.shape[1:])
        self.keys = keys.view(np.uint8).reshape(len(keys), width)

    def __len__(self) -> int:
        return len(self.ns)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return BlockRefs(self.ns[i], self.keys[i])
        return BlockRef(int(self.ns[i]), self.keys[i].tobytes())

    def __iter__(self) -> Iterator[BlockRef]:
        # Built by tuple.__new__ through map: no Python frame per block.
        pairs = zip(self.ns.tolist(), self.key_bytes(), strict=True)
        return map(tuple.__new__, repeat(BlockRef), pairs)  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        # Equal to the list (or tuple) of the same items it stands for; not to any sequence
        # (a string is one).
        if not isinstance(other, (list, tuple, type(self))):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def key_bytes(self, rows: np.ndarray | None = None) -> list[bytes]:
        """Each key (of ``rows`` only, when given) as bytes."""
        keys = self.keys if rows is None else self.keys[rows]
        raw, width = keys.tobytes(), keys.shape[1]
        return [raw[i : i + width] for i in range(0, len(raw), width)] if width else []


def ref_columns(refs: Sequence[BlockRef], rows: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
    """The namespace ids (uint64) and key bytes of ``refs[rows]``: straight from the arrays of
    ``BlockRefs``, else block by block."""
    if isinstance(refs, BlockRefs):
        return refs.ns[rows], refs.key_bytes(rows)
    picked = [refs[i] for i in rows.tolist()]
    return (
        np.fromiter((r[0] for r in picked), dtype=np.uint64, count=len(picked)),
        [bytes(r[1]) for r in picked],
    )


def ref_keys(refs: Sequence[BlockRef]) -> list[bytes]:
    """Each ref's key bytes: straight from the arrays of ``BlockRefs`` (indexing one makes a
    ``BlockRef``, microseconds a block), else block by block."""
    if isinstance(refs, BlockRefs):
        return refs.key_bytes()
    return [bytes(r[1]) for r in refs]


@dataclass(frozen=True, slots=True)
class WriteBatch:
    """Write ``len(slots)`` blocks of ``nbytes`` each from ``src`` into ``slots``."""

    slots: Sequence[int]
    blocks: Sequence[BlockRef]
    nbytes: int
    src: HostBuffers | PoolPages | DevicePages
    priority: Priority = Priority.BACKGROUND
    rank: int = 0  # within ``priority``: higher sooner (see ``Priority``)
    urgency: Urgency | None = None  # the move's, when a waiter may raise it (``Urgency``)


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """Read blocks of ``nbytes`` from ``slots`` into ``dest``. ``checksums[j]`` is what the
    tier's ``write`` returned for block ``j`` (tiers that do not checksum ignore it)."""

    slots: Sequence[int]
    blocks: Sequence[BlockRef]
    nbytes: int
    dest: HostBuffers | PoolPages | DevicePages
    checksums: Sequence[int] = ()
    priority: Priority = Priority.DEMAND
    rank: int = 0  # within ``priority``: higher sooner (see ``Priority``)
    urgency: Urgency | None = None  # the move's, when a waiter may raise it (``Urgency``)


class WriteOutcome(NamedTuple):
    """``ok``: the block is stored (durable and indexed on a persistent tier). ``checksum``
    is valid only when ``ok`` and the tier checksums. A named tuple: a batch makes one per
    block (see ``BlockRef``)."""

    slot: int
    ok: bool
    checksum: int = 0


# ``WriteOutcomes.all_stored``'s columns for one block, read-only: shared by every batch.
_ONE_OK = np.ones(1, dtype=bool)
_ONE_OK.flags.writeable = False
_ONE_CHECKSUM = np.zeros(1, dtype=np.uint64)
_ONE_CHECKSUM.flags.writeable = False


class WriteOutcomes(Sequence[WriteOutcome]):
    """A batch's outcomes as three arrays (slots, ok, checksums), read as a sequence of
    ``WriteOutcome``: the store takes the columns whole, so a batch of thousands of blocks
    costs no object per block."""

    __slots__ = ("checksums", "ok", "slots")

    def __init__(self, slots: np.ndarray, ok: np.ndarray, checksums: np.ndarray) -> None:
        self.slots = np.asarray(slots, dtype=np.int64)
        self.ok = np.asarray(ok, dtype=bool)
        self.checksums = np.where(self.ok, np.asarray(checksums, dtype=np.uint64), 0).astype(
            np.uint64
        )

    @classmethod
    def all_stored(cls, slots: np.ndarray) -> WriteOutcomes:
        """Every block of ``slots`` (int64) stored, without checksums: a host-memory tier's
        batch, which cannot fail block by block. Built without the masking of checksums
        that ``__init__`` does (half the cost of a single-block put's copy into L1)."""
        out = cls.__new__(cls)
        out.slots = slots
        if len(slots) == 1:  # a single-block put's: the columns every such batch shares
            out.ok, out.checksums = _ONE_OK, _ONE_CHECKSUM
            return out
        # np.ones is a Python function around these two calls, and costs twice as much.
        out.ok = np.empty(len(slots), dtype=bool)
        out.ok.fill(True)
        out.checksums = np.zeros(len(slots), dtype=np.uint64)
        return out

    @classmethod
    def of(cls, outcomes: Sequence[WriteOutcome]) -> WriteOutcomes:
        """The arrays of any tier's outcomes."""
        if isinstance(outcomes, WriteOutcomes):
            return outcomes
        n = len(outcomes)
        return cls(
            np.fromiter((o[0] for o in outcomes), dtype=np.int64, count=n),
            np.fromiter((o[1] for o in outcomes), dtype=bool, count=n),
            np.fromiter((o[2] for o in outcomes), dtype=np.uint64, count=n),
        )

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return WriteOutcomes(self.slots[i], self.ok[i], self.checksums[i])
        return WriteOutcome(int(self.slots[i]), bool(self.ok[i]), int(self.checksums[i]))

    def __iter__(self) -> Iterator[WriteOutcome]:
        return iter(write_outcomes(self.slots.tolist(), self.ok.tolist(), self.checksums.tolist()))

    def __eq__(self, other: object) -> bool:
        # Equal to the list (or tuple) of the same items it stands for; not to any sequence
        # (a string is one).
        if not isinstance(other, (list, tuple, type(self))):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


def write_outcomes(
    slots: Iterable[int], oks: Iterable[bool], checksums: Iterable[int]
) -> list[WriteOutcome]:
    """One outcome per slot (``oks`` and ``checksums`` as long, or ``repeat(value)``), built
    without a call of the named tuple's ``__new__`` each: a third of the cost, for the
    thousands of blocks a batch of small ones has."""
    rows = zip(slots, oks, checksums, strict=False)
    return list(map(tuple.__new__, repeat(WriteOutcome), rows))


@dataclass(frozen=True, slots=True)
class RecoveredBlock:
    """A block a persistent tier found at start, its slot already claimed."""

    ns: int
    key: bytes
    slot: int
    nbytes: int
    checksum: int
    written_at: float


@dataclass(frozen=True)
class RecoveredBlocks:
    """Blocks a persistent tier found at start, their slots already claimed, as arrays (a
    million of them cost no Python object each)."""

    ns: np.ndarray  # uint64
    keys: np.ndarray  # (n, 32) uint8
    slots: np.ndarray  # int64
    nbytes: np.ndarray  # int64
    checksums: np.ndarray  # uint64
    written_at: np.ndarray  # float64

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[RecoveredBlock]:
        for i in range(len(self)):
            yield RecoveredBlock(
                int(self.ns[i]),
                self.keys[i].tobytes(),
                int(self.slots[i]),
                int(self.nbytes[i]),
                int(self.checksums[i]),
                float(self.written_at[i]),
            )

    def take(self, rows: np.ndarray) -> RecoveredBlocks:
        """The blocks at positions ``rows``."""
        return RecoveredBlocks(*(getattr(self, f)[rows] for f in _RECOVERED_FIELDS))

    def latest_of_each_key(self) -> np.ndarray:
        """Positions of one row of each distinct ``(ns, key)``, in order: the one written last
        (``written_after``). A tier whose index does not enforce one row per key may hand over
        two: a block deleted or evicted where its slot could not be freed, then its key put
        again, perhaps with other bytes. A mixed 64-bit hash of each row is sorted; only rows
        whose hashes repeat are compared in full, so a chunk without repeats costs one sort."""
        n = len(self)
        everything = np.arange(n)
        if n < 2:
            return everything
        words = np.ascontiguousarray(self.keys).view(np.uint64).reshape(n, 4)
        with np.errstate(over="ignore"):
            mixed = self.ns.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            for i, mult in enumerate(_KEY_MIX):
                mixed = (mixed ^ words[:, i]) * np.uint64(mult)
        order = np.argsort(mixed, kind="stable")
        repeats = mixed[order[1:]] == mixed[order[:-1]]
        if not repeats.any():
            return everything
        suspects = np.unique(np.concatenate([order[1:][repeats], order[:-1][repeats]]))
        latest: dict[tuple[int, bytes], int] = {}
        for i in suspects.tolist():
            key = (int(self.ns[i]), self.keys[i].tobytes())
            j = latest.setdefault(key, i)
            if written_after(self.written_at[i], self.slots[i], self.written_at[j], self.slots[j]):
                latest[key] = i
        keep = np.ones(n, dtype=bool)
        keep[suspects] = False
        keep[list(latest.values())] = True
        return np.flatnonzero(keep)

    @classmethod
    def of(cls, blocks: Sequence[RecoveredBlock]) -> RecoveredBlocks:
        n = len(blocks)
        return cls(
            np.fromiter((b.ns for b in blocks), np.uint64, n),
            np.frombuffer(b"".join(b.key for b in blocks), np.uint8).reshape(n, 32).copy(),
            np.fromiter((b.slot for b in blocks), np.int64, n),
            np.fromiter((b.nbytes for b in blocks), np.int64, n),
            np.fromiter((b.checksum for b in blocks), np.uint64, n),
            np.fromiter((b.written_at for b in blocks), np.float64, n),
        )

    @classmethod
    def concat(cls, parts: Sequence[RecoveredBlocks]) -> RecoveredBlocks:
        if not parts:
            return cls.of([])
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in _RECOVERED_FIELDS))


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum a ``checksummed`` tier keeps of each block and verifies at every read:
    xxh3-64 of its bytes, as an unsigned int."""
    return int(xxhash.xxh3_64_intdigest(data))


def written_after(written_at: Any, slot: Any, other_written_at: Any, other_slot: Any) -> Any:
    """Whether a key's row (``written_at``, ``slot``) was written after another of that key,
    elementwise over arrays: the later ``written_at``; of two written at the same time, the
    one in the higher slot (any rule that always answers the same would do)."""
    return (written_at > other_written_at) | (
        (written_at == other_written_at) & (slot > other_slot)
    )


_RECOVERED_FIELDS = ("ns", "keys", "slots", "nbytes", "checksums", "written_at")
# Odd multipliers that spread each key word over the 64-bit row hash.
_KEY_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD)


# ----------------------------------------------------------------------------- tiers


class SlotTier(Protocol):
    """A tier that owns slots (L0, L1, L2, the in-memory test tier).

    Capabilities, so that the store branches on what a tier does, never on which it is:
    ``persistent`` tiers survive a restart (``recover`` hands back their blocks once) and
    their ``remove`` is I/O (it runs on a worker thread; their allocator is thread-safe);
    ``checksummed`` tiers return a checksum per written block that the store keeps and hands
    back to ``read``, which verifies it.
    """

    @property
    def kind(self) -> TierKind: ...

    @property
    def persistent(self) -> bool: ...

    @property
    def checksummed(self) -> bool: ...

    @property
    def allocator(self) -> SlabAllocator: ...

    def write(self, batch: WriteBatch) -> Sequence[WriteOutcome]:
        """Store the batch's blocks in their (allocated) slots (``WriteOutcomes`` where the
        tier has them as arrays). A failed block keeps its slot
        allocated: give it back with ``remove``."""
        ...

    def read(self, batch: ReadBatch) -> list[bool]:
        """Copy blocks into ``batch.dest``; False is a miss (verification or I/O failed): the
        destination's bytes for that block are then unspecified and must not be used, and
        the tier has dropped the block (the caller forgets its copy). TierMemoryExhausted
        (the GPU tier): no memory for the copy; the blocks are kept."""
        ...

    def remove(self, slots: Sequence[int]) -> bool:
        """Forget the blocks in ``slots`` and free the slots. False: nothing was freed."""
        ...

    def removing(self, slots: Sequence[int], refs: Sequence[BlockRef] | None = None) -> None:
        """``slots``, whose blocks are gone (or whose rows a later row of the key replaced,
        kept for reads in flight: ``SpaceManager.free_when_idle``), are on their way to
        ``remove`` (which may run later, or fail): a persistent tier's next block commit of
        one of their keys deletes their rows in its own transaction, nothing freed, so that a
        block of the same key put meanwhile never commits beside its older row (a crash
        between left both, and the next start's recovery served the older until it read the
        newer). ``refs``: the block each slot held (the same length); without them, the next
        block commit of any key deletes the rows. Volatile tiers do nothing."""
        ...

    def rows_left(self, refs: Sequence[BlockRef]) -> bool:
        """Whether a persistent tier's index may still hold a row of one of ``refs``' blocks
        (namespace and key) in a slot on its way to ``remove`` or whose ``remove`` failed
        (``removing``; one noted without its key may hold any key's until its row is read):
        a restart would bring that block back. A lookup per key, on the caller's thread.
        Volatile tiers: False."""
        ...

    def drop_rows_left(self, refs: Sequence[BlockRef]) -> bool:
        """Delete, in one commit, the rows of ``refs``' blocks ``rows_left`` finds, as a block
        commit of those keys does (``removing``): nothing freed, their ``remove`` frees the
        slots. A slot that may hold any key's row has its row read first: no commit where
        no row is of ``refs``. False where the commit failed: the rows may still be there.
        I/O: called on a worker thread. Volatile tiers: True."""
        ...

    def recover_chunks(self, rows: int = 65536) -> Iterator[RecoveredBlocks]:
        """The blocks a persistent tier holds from before this start, a chunk at a time, once.
        Their slots are claimed as they are handed over; until the last chunk is out the
        tier allocates nothing (slots of rows not read yet must not be handed out). Other
        tiers yield nothing."""
        ...

    def health(self) -> TierHealth: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


class KeyTier(Protocol):
    """A key-addressed tier (L3): its own index, asynchronous verbs on the event loop.

    ``probe`` answers the leading blocks of a chain that are present, ``probe_each`` whether
    each block is present, absent or unknown (the store could not be asked); ``read`` copies
    blocks into ``dest`` (per block True, or a miss: False where the block is not there, absent
    or corrupt, None where the tier could not tell, its store unreachable, the read timed out or
    failed); ``write`` stores blocks from ``src`` and answers per block whether it is stored.
    None of them raises for a remote fault: a tier that cannot reach its store answers misses
    (unknown: None for ``read``, ``PROBE_UNKNOWN`` for ``probe_each``) and reports DOWN.
    """

    @property
    def kind(self) -> TierKind: ...

    async def probe(self, blocks: Sequence[BlockRef]) -> list[int]:
        """The size in bytes of each block of the present prefix of ``blocks`` (its length
        is the prefix's; empty when the first is absent or the tier cannot tell), as the block
        was written: a read of the block at another size is a miss."""
        ...

    async def probe_each(self, blocks: Sequence[BlockRef]) -> list[int]:
        """Each block's size as ``probe`` gives it, ``PROBE_ABSENT`` where the tier holds no
        such block, and ``PROBE_UNKNOWN`` where it cannot tell (its answer late, the store
        unreachable, a command's error): one entry per block, in one round trip as ``probe``.
        ``probe`` is the leading sizes of this answer."""
        ...

    async def value_ages(self, blocks: Sequence[BlockRef]) -> list[float]:
        """How long ago each block's value was written, in seconds, as far as its expiry
        tells: where it expires in ``r`` and the tier writes values to last ``ttl``, ``ttl -
        r`` (one another node wrote to last longer: 0.0, as if written now). 0.0 where the
        tier cannot tell (no such value, values that do not expire, no answer). One round
        trip; none of it on a lookup's path (it answers no probe)."""
        ...

    async def read(
        self, blocks: Sequence[BlockRef], nbytes: int, dest: HostBuffers | PoolPages
    ) -> list[bool | None]:
        """Copy each block into ``dest``: True, read; False, the tier holds no such block (or
        one that failed verification: the holder forgets that copy); None, a miss that says
        nothing of the block (the store unreachable or the read failed: it may still be there,
        and be read once the store answers again). A missed block's bytes in ``dest`` are
        unspecified."""
        ...

    async def write(
        self, blocks: Sequence[BlockRef], nbytes: int, src: HostBuffers | PoolPages
    ) -> list[bool]: ...

    async def remove(self, blocks: Sequence[BlockRef]) -> None: ...

    def unserved(self, blocks: Sequence[BlockRef]) -> list[int]:
        """The positions of the blocks that ``read`` misses now without asking the store
        (None at once): every one while the tier is down, those of a part of the store it
        knows it cannot reach (a cluster's lost master); none while it is OK. No round trip:
        the store skips promotions, answers lookups and lets puts store such blocks by it."""
        ...

    def set_write_rate(self, bytes_s: int) -> None:
        """The tier's write budget (bytes/s, 0: unlimited): ``write`` answers False for the
        blocks beyond it (they are dropped, never queued: the tier is written behind)."""
        ...

    def health(self) -> TierHealth: ...

    def stats(self) -> TierStats: ...

    async def close(self) -> None: ...


class RemovalJournal(Protocol):
    """Where a key-addressed tier keeps, durably, the removals its store has not confirmed
    (the disk tier, in its index: ``DiskTier.removals``), so that a restart sends them again
    and answers their keys absent meanwhile. Entries are ``(store key, until)``: until a
    wall-clock time past which the store has dropped the value anyway (None: never).

    Thread-safety: called from a worker thread, one call at a time."""

    def removals(self) -> list[tuple[bytes, float | None]]:
        """Every entry kept (none when they cannot be read)."""
        ...

    def record_removals(
        self, added: Sequence[tuple[bytes, float | None]], dropped: Sequence[bytes]
    ) -> bool:
        """Keep ``added`` (replacing an entry of the same key) and forget ``dropped``, at once
        and durably before returning. False: not recorded."""
        ...


class QuarantinedSlot(NamedTuple):
    """A slot a tier holds out of use after a read of it failed (``Quarantine``)."""

    slot: int
    slot_bytes: int  # its extent's size
    file: str  # the data file it lies in
    offset: int  # its byte offset in that file
    reason: str  # why (the read's error), or why a release kept it
    at: float  # when, in seconds since the epoch (0: not recorded)
    # Whether the last release that came to it checked it and the check failed (in memory:
    # not since the daemon started); False where that release left it unchecked (a read in
    # flight, its free under way), and a release naming no slot may leave the others untried.
    tried: bool


class QuarantineRelease(NamedTuple):
    """What ``Quarantine.release_quarantined`` did."""

    released: list[int]  # the slots back in use
    # Named but held still: their check failed, or they were left unchecked for a later
    # release (``tried`` False); the reason says which.
    kept: list[QuarantinedSlot]


class Quarantine(Protocol):
    """A slot tier that holds slots whose reads failed out of use (the disk tier), and lets an
    operator list them and give them back.

    Thread-safety: called from a worker thread; blocking."""

    def quarantined(self) -> list[QuarantinedSlot]:
        """Every slot held, in slot order."""
        ...

    def release_quarantined(
        self, slots: Sequence[int] | None = None, limit: int | None = None
    ) -> QuarantineRelease:
        """Give ``slots`` (when None, every slot held, or the next ``limit`` of them: see the
        disk tier) back to use, each only once its extent took a write and gave it back.
        Raises TierUnavailable, changing nothing, while the tier is degraded (but by a failed
        read: a release whose every check passed ends that fault) or recovering, and
        ValueError for a slot it does not hold."""
        ...


class DeviceBridge(Protocol):
    """What a slot tier whose slots are device memory (L0, ``device_memory = True``) also
    does for the others: move a GPU pool's pages (``DevicePages``) to and from host buffers
    without an L0 slot. Only such a tier can reach GPU pool memory, so every other tier's
    traffic with a GPU pool goes through these (host buffers being its slots, when they are
    host memory, or staging from ``host_buffers``). False: the device failed, the
    destination's bytes are unspecified and the tier reports why in ``health()``.
    TierMemoryExhausted: the device had no memory for the copy (a group of it, the groups
    before having landed): the destination's bytes are unspecified as after a False, while
    the tier, its health and its blocks are unchanged."""

    def pool_to_host(self, src: DevicePages, dest: HostBuffers, nbytes: int) -> bool: ...

    def host_to_pool(self, src: HostBuffers, dest: DevicePages, nbytes: int) -> bool: ...

    def host_buffers(self, n: int, nbytes: int) -> HostBuffers:
        """Staging in host memory for ``n`` blocks (page-locked where the device has it)."""
        ...

    def health(self) -> TierHealth: ...


BlockTier: TypeAlias = "SlotTier | KeyTier"
