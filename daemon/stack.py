"""The tier stack: the configured tiers ordered by kind, each with the rules that run it.

A daemon runs any ordered subset of L0 (GPU), L1 (host), L2 (disk), L3 (remote); L1 always.
Tiers are addressed by ``TierKind``, never by list position: ``stack[kind]``, ``below(kind)``,
``above(kind)``. Each ``Level`` carries its tier, its column in the block table, its eviction
policy and guard (pins, protection, warm-up, watermarks), the admission rule for blocks coming
into it from above, the top tier's policy's own admission where it has one (``OwnAdmission``),
how blocks reach it (``write_policy``) and its bandwidth limits.

What the store may ask of a level is decided by the tier's capabilities, never by which tier it
is: ``keyed`` (a key-addressed tier), ``persistent`` (survives restarts; removals are I/O),
``checksummed``, whether it exposes its slots as host buffers (``buffers``), and whether its
slots are device memory (``device_memory``: the GPU tier, which alone reaches a GPU pool's
pages; the stack's ``device`` level lends that reach to the other tiers).

Thread-safety: immutable after construction, except the policies (event loop only).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.daemon.config import Config
from kvtier.daemon.policy.admission import Admission, AlwaysAdmit, make_admission
from kvtier.daemon.policy.base import EvictionPolicy
from kvtier.daemon.policy.guard import EvictionGuard
from kvtier.daemon.policy.registry import default_admission, make_policy
from kvtier.tiers.base import DeviceBridge, HostBuffers, KeyTier, SlotTier, TierKind

log = logging.getLogger(__name__)


class TokenBucket:
    """Bytes per second with a burst of one second's worth; 0 means unlimited."""

    def __init__(self, rate_bytes_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(rate_bytes_s)
        self._clock = clock
        self._tokens = self.rate
        self._last = clock()

    def delay_for(self, nbytes: int) -> float:
        """Take ``nbytes`` and return how long to wait before using them."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


@dataclass(frozen=True, slots=True)
class OwnAdmission:
    """A policy's own admission (hit density's ``admits_many`` and ``note_miss``), resolved
    once when the level is built, so a level whose policy has none (``heat``) pays nothing
    per request for it."""

    admits_many: Callable[[Sequence[int], Sequence[int], int, float], list[bool]]
    note_miss: Callable[[int, int, float], None]
    reason: str  # the label of its decisions in the admission counter: the policy's name


@dataclass(eq=False)
class Level:
    kind: TierKind
    tier: Any  # SlotTier | KeyTier
    col: int
    policy: EvictionPolicy
    guard: EvictionGuard
    admission: Admission
    write_policy: str  # how blocks reach this tier from above: write_back/write_through/selective
    reads: TokenBucket
    writes: TokenBucket
    own_admission: OwnAdmission | None = None

    # A level's kind and tier never change: what follows from them alone is kept (asked on
    # every request's path).
    @functools.cached_property
    def label(self) -> str:
        return self.kind.label

    @functools.cached_property
    def keyed(self) -> bool:
        return not hasattr(self.tier, "allocator")

    @property
    def persistent(self) -> bool:
        return bool(getattr(self.tier, "persistent", True))

    @property
    def checksummed(self) -> bool:
        return bool(getattr(self.tier, "checksummed", False))

    @property
    def recovering(self) -> bool:
        """A persistent tier still handing over its blocks from before this start: it
        allocates nothing until it is done."""
        return bool(getattr(getattr(self.tier, "allocator", None), "recovering", False))

    @property
    def quarantined_bytes(self) -> int:
        """The slot bytes the tier holds out of use (a disk tier's quarantined slots): in its
        used room, yet no block's."""
        held = getattr(self.tier, "quarantined_bytes", None)
        return held() if held is not None else 0

    def retry_writes_now(self) -> None:
        """Have a tier degraded by a fault that may pass (a disk's full disk or locked index)
        let the next write through now, not at its next retry; a no-op for other tiers."""
        retry = getattr(self.tier, "retry_writes_now", None)
        if retry is not None:
            retry()

    @property
    def admits_all(self) -> bool:
        return isinstance(self.admission, AlwaysAdmit)

    @functools.cached_property
    def host_memory(self) -> bool:
        """Whether the tier's slots are host memory (it exposes them as buffers)."""
        return not self.keyed and self.buffers([], 4096) is not None

    def buffers(self, slots: Sequence[int], nbytes: int) -> HostBuffers | None:
        """The slots as host buffers, for tiers whose slots are host memory; else None."""
        fn = getattr(self.tier, "buffers", None)
        return fn(slots, nbytes) if fn is not None else None

    @property
    def device_memory(self) -> bool:
        """Whether the tier's slots are device memory: it reads and writes a GPU pool's
        pages (``DevicePages``) itself, and moves them to and from host buffers for the
        other tiers (``bridge``)."""
        return bool(getattr(self.tier, "device_memory", False))

    @property
    def slots(self) -> SlotTier:
        return self.tier  # type: ignore[no-any-return]

    @property
    def bridge(self) -> DeviceBridge:
        return self.tier  # type: ignore[no-any-return]

    @property
    def keys(self) -> KeyTier:
        return self.tier  # type: ignore[no-any-return]


class TierStack:
    def __init__(self, levels: Sequence[Level]) -> None:
        kinds = [lv.kind for lv in levels]
        if kinds != sorted(set(kinds)):
            raise ValueError(f"tiers must be distinct kinds, fastest first: {kinds}")
        if not levels or levels[0].keyed:
            raise ValueError("the fastest tier must own slots")
        self.levels = list(levels)
        self._by_kind = {lv.kind: lv for lv in levels}
        # The tier whose slots are device memory (L0), when there is one: the only way
        # between a GPU pool's pages and the other tiers.
        self.device: Level | None = next((lv for lv in levels if lv.device_memory), None)

    def __iter__(self) -> Iterator[Level]:
        return iter(self.levels)

    def __len__(self) -> int:
        return len(self.levels)

    def __getitem__(self, kind: TierKind) -> Level:
        return self._by_kind[kind]

    def __contains__(self, kind: object) -> bool:
        return kind in self._by_kind

    @property
    def top(self) -> Level:
        return self.levels[0]

    def below(self, kind: TierKind) -> Level | None:
        i = self.levels.index(self._by_kind[kind])
        return self.levels[i + 1] if i + 1 < len(self.levels) else None

    def above(self, kind: TierKind) -> Level | None:
        i = self.levels.index(self._by_kind[kind])
        return self.levels[i - 1] if i > 0 else None

    def lower(self, kind: TierKind) -> list[Level]:
        """Every level below ``kind``, fastest first."""
        i = self.levels.index(self._by_kind[kind])
        return self.levels[i + 1 :]

    def first_persistent(self) -> Level | None:
        return next((lv for lv in self.levels if lv.persistent and not lv.keyed), None)

    def close(self) -> None:
        for lv in self.levels:
            if not lv.keyed:
                lv.slots.close()


def build_stack(
    config: Config,
    tiers: Sequence[Any] | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> TierStack:
    """The daemon's tier stack: ``tiers`` as given (tests), or the ones ``config`` enables."""
    if tiers is None:
        tiers = open_tiers(config)
    tiers = sorted(tiers, key=lambda t: t.kind)
    levels = []
    for col, tier in enumerate(tiers):
        section = getattr(config.tiers, tier.kind.label.lower(), None)
        levels.append(_level(config, section, tier, col, is_top=col == 0, clock=clock))
    return TierStack(levels)


def _level(
    config: Config,
    section: Any,
    tier: Any,
    col: int,
    *,
    is_top: bool,
    clock: Callable[[], float],
) -> Level:
    pc = config.policy
    name = (getattr(section, "policy", "") if section is not None else "") or pc.name
    high = getattr(section, "high_watermark", 0.95)
    low = getattr(section, "low_watermark", 0.90)
    keyed = not hasattr(tier, "allocator")
    # A key-addressed tier is written behind, by its admission rule, never by demotion.
    write_policy = getattr(section, "write_policy", "selective" if keyed else "write_back")
    if is_top:
        admission: Admission = make_admission("always")
    else:
        chosen = getattr(section, "admission", "")
        if not chosen:
            chosen = "second_hit" if write_policy == "selective" else default_admission(name)
        admission = make_admission(chosen)
    policy = make_policy(name, half_life_s=pc.half_life_s)
    own = None
    admits_many = getattr(policy, "admits_many", None)
    note_miss = getattr(policy, "note_miss", None)
    # As in the replayer: a policy's own admission decides what the top tier keeps; a lower
    # tier admits by its rule alone (there, density's own admission declined demoted blocks
    # that were hit later).
    if is_top and admits_many is not None and note_miss is not None:
        own = OwnAdmission(admits_many, note_miss, name)
    return Level(
        kind=tier.kind,
        tier=tier,
        col=col,
        policy=policy,
        guard=EvictionGuard(pc.protect_s, pc.warmup_s, high, low),
        admission=admission,
        write_policy=write_policy,
        reads=TokenBucket(getattr(section, "read_bytes_s", 0), clock),
        # A key-addressed tier keeps its own write budget and drops what exceeds it (written
        # behind, nothing waits for it); a wait here would only delay writes it then drops.
        writes=TokenBucket(0 if keyed else getattr(section, "write_bytes_s", 0), clock),
        own_admission=own,
    )


def open_tiers(config: Config) -> list[Any]:
    """Open the tiers ``config`` enables. Slow-to-fail tiers first: a disk tier that cannot
    start (no room, directory in use) fails before the host arena spends seconds pre-faulting
    memory."""
    from kvtier.tiers.host import HostArena

    tiers: list[Any] = []
    c3 = config.tiers.l3
    if c3.enabled:
        from kvtier.tiers.remote.tier import RemoteTier

        # Connects when the store opens on the event loop (BlockStore.open).
        tiers.append(RemoteTier(c3.tier_options()))
    c2 = config.tiers.l2
    if c2.enabled:
        from kvtier.tiers.disk import DiskTier

        tiers.append(
            DiskTier(
                c2.path,
                c2.capacity_bytes,
                c2.segment_bytes,
                io_threads=c2.io_threads,
                file_bytes=c2.file_bytes,
                direct_io=c2.direct_io,
                enospc_retry_s=c2.enospc_retry_s,
                index_watch_s=c2.index_watch_s,
                recover_later=True,
            )
        )
    try:
        c0 = config.tiers.l0
        if c0.enabled:
            from kvtier.tiers.device import DeviceTier

            l0 = DeviceTier(
                c0.capacity_bytes, c0.segment_bytes, device=c0.device, streams=c0.streams
            )
            tiers.append(l0)
            choose_l2_path(config, l0)
        c1 = config.tiers.l1
        tiers.append(
            HostArena(
                c1.capacity_bytes,
                c1.segment_bytes,
                pin_cuda=_want_pinning(config),
                prefault=c1.prefault,
            )
        )
    except BaseException:
        for t in tiers:
            if not asyncio.iscoroutinefunction(t.close):
                t.close()
        raise
    return tiers


def choose_l2_path(config: Config, l0: Any) -> None:
    """Decide once, after the disk tier opened, how L2 <-> L0 transfers go, and record it on
    the GPU tier, whose stats report it (gauges ``gds_usable``, ``l2_gds``). Raises
    TierUnavailable when ``tiers.l0.gds`` is ``true`` and GPUDirect Storage is not usable,
    or there is no disk tier to use it with.

    The transfer engine has no direct L2 <-> L0 route yet (it needs the disk tier to keep
    the device digest of ``tiers/gds.py`` beside its host checksum): even where GPUDirect
    Storage is usable, blocks move through host staging, and ``l2_gds`` says so (0)."""
    from kvtier.tiers.base import TierUnavailable
    from kvtier.tiers.gds import choose

    c0, c2 = config.tiers.l0, config.tiers.l2
    if not c2.enabled:
        if c0.gds == "true":
            raise TierUnavailable("tiers.l0.gds=true needs the disk tier (tiers.l2.enabled=true)")
        l0.l2_path, l0.l2_path_reason = "none", "no disk tier"
        return
    choice = choose(c0.gds, c2.path, l0.device)
    l0.gds_usable = choice.active
    if choice.active:
        l0.l2_path = "pinned_l1"
        l0.l2_path_reason = (
            "GPUDirect Storage is usable, but the direct L2 <-> L0 route is not wired: "
            "through host staging"
        )
    else:
        l0.l2_path, l0.l2_path_reason = "pinned_l1", choice.reason
    log.info("L2 <-> L0 transfers: %s (%s)", l0.l2_path, l0.l2_path_reason)


def _want_pinning(config: Config) -> bool:
    setting = config.tiers.l1.pin_memory
    if setting == "auto":
        # Importing torch costs a second or two: only ask it when a GPU driver is present.
        if not os.path.exists("/dev/nvidiactl"):
            return False
        try:
            import torch
        except ImportError:
            # The image (no torch) on a GPU node whose container runtime mounts the driver's
            # devices: auto is "if a GPU", not a start that fails.
            log.info(
                "L1 is not page-locked (tiers.l1.pin_memory=auto): this host has a GPU "
                "driver, but torch, which pins it, is not installed (pip install "
                "'kvtier[torch]')"
            )
            return False
        return bool(torch.cuda.is_available())
    return setting == "true"
