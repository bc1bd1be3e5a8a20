"""KVService's session rules, against a store that awaits where the real one may."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

import numpy as np
import pytest

from kvtier.daemon import loops
from kvtier.daemon import service as service_module
from kvtier.daemon import store as store_module
from kvtier.daemon.config import Config, load_config
from kvtier.daemon.credentials import FdCloser, TicketBook, TicketKind, ticket_digest
from kvtier.daemon.errors import (
    Draining,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from kvtier.daemon.pools import PoolRegistry
from kvtier.daemon.service import EXPIRY_SLICE_LEASES, KVService
from kvtier.daemon.sessions import PeerCred, Session, SessionRegistry, lease_bytes
from kvtier.daemon.stats import Counters
from kvtier.daemon.store import BlockStore, PutResult
from kvtier.daemon.table import BlockTable, keys_to_words
from kvtier.daemon.tenants import Space, Tenant, TenantDirectory, _digest
from kvtier.kernels.layout import PoolLayout
from kvtier.tiers.base import BlockRef, HostBuffers, TierKind
from kvtier.tiers.host import HostArena
from kvtier.tiers.memory import MemoryKeyTier, MemoryTier

PEER = PeerCred(pid=1, uid=1000, gid=1000)
T = TypeVar("T")


class SlowStore:
    """Finds every key; its lookup waits until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.pins = 0
        self.unpin_calls = 0
        self.counters = Counters()
        self.touched: list[object] = []  # each get's touch

    async def lookup(
        self, ns: int, words: np.ndarray, owner: int = 0
    ) -> tuple[int, np.ndarray, np.ndarray]:
        await self.release.wait()
        n = len(words)
        return n, np.full(n, 2, dtype=np.int32), np.arange(n, dtype=np.int64)

    def pin(self, bids: np.ndarray) -> np.ndarray:
        self.pins += len(bids)
        return bids

    def unpin(self, refs: np.ndarray, *, distinct: bool = True) -> None:
        self.pins -= len(refs)
        self.unpin_calls += 1

    def promote_in_background(self, bids: np.ndarray) -> None:
        pass

    def owner_of(self, label: str) -> int:
        return 0

    def max_block_bytes(self) -> int:
        return 1 << 20

    async def get(
        self, pool: object, ns: int, words: np.ndarray, pages: np.ndarray, **kwargs: object
    ) -> np.ndarray:
        self.touched.append(kwargs["touch"])
        return np.ones(len(words), dtype=bool)


def _service(
    store: object, config: Config | None = None, clock: Callable[[], float] = time.monotonic
) -> tuple[KVService, TicketBook]:
    tickets = TicketBook(FdCloser())
    service = KVService(
        config or Config(),
        store,  # type: ignore[arg-type]
        PoolRegistry("/dev/shm"),
        SessionRegistry(),
        tickets,
        clock=clock,
    )
    return service, tickets


def _open(service: KVService, tickets: TicketBook) -> str:
    ticket = tickets.issue(TicketKind.SESSION, PEER)
    return service.open_session("t", ticket, unix_socket=True).session_id


def _leasing(max_leases_per_session: int) -> tuple[SlowStore, KVService, TicketBook, list[float]]:
    """A SlowStore that answers at once, its service under ``server.max_leases_per_session``
    and the clock ``now[0]`` (from 100.0): store, service, tickets, now."""
    store = SlowStore()
    store.release.set()
    now = [100.0]
    config = load_config(None, [f"server.max_leases_per_session={max_leases_per_session}"])
    service, tickets = _service(store, config, clock=lambda: now[0])
    return store, service, tickets, now


async def _each_step(read: Callable[[], int], call: Awaitable[T]) -> tuple[T, list[int]]:
    """``call``'s result and ``read()`` at each turn of the event loop while it ran, the
    first before it began and the last after it ended."""
    seen: list[int] = []

    async def watch() -> None:
        while True:
            seen.append(read())
            await asyncio.sleep(0)

    watcher = asyncio.ensure_future(watch())
    await asyncio.sleep(0)
    try:
        result = await call
    finally:
        watcher.cancel()
    seen.append(read())
    return result, seen


@contextlib.asynccontextmanager
async def _putting_session(
    overrides: list[str], pages: int
) -> AsyncIterator[tuple[BlockStore, KVService, str, int]]:
    """A store with an L1 of 8 blocks of 64 KiB under ``overrides``, its service, and one
    session with a registered memfd pool of ``pages`` 4 KiB pages (store, service, session,
    pool id); all closed on exit."""
    seg = 64 * 1024
    config = load_config(None, overrides)
    store = BlockStore(config, tiers=[HostArena(8 * seg, seg)])
    service, tickets = _service(store, config)
    session = _open(service, tickets)
    layout = PoolLayout.staging(
        num_layers=1, num_pages=pages, block_tokens=1, chunk_bytes=4096, kv_count=1
    )
    fd = os.memfd_create("kvtier-test")
    try:
        os.ftruncate(fd, layout.extent_bytes)
        os.posix_fallocate(fd, 0, layout.extent_bytes)
        pool = await service.pools.register_fd(session, fd, layout.extent_bytes, layout)
        yield store, service, session, pool.pool_id
    finally:
        os.close(fd)
        service.close_session(session)
        await store.stop(flush=False)
        store.close()


def test_regression_a_session_ending_during_a_pinning_lookup_left_its_pins():
    async def run() -> None:
        store = SlowStore()
        service, tickets = _service(store)
        session = _open(service, tickets)
        lookup = asyncio.ensure_future(service.lookup(session, [bytes(32)] * 3, True, 0))
        await asyncio.sleep(0)
        service.close_session(session)  # the client died while its lookup was in the store
        store.release.set()
        with pytest.raises(NotFound):
            await lookup
        assert store.pins == 0 and service.sessions.lease_count == 0

    asyncio.run(run())


def test_a_unix_socket_session_needs_a_ticket_and_tcp_sessions_register_no_memory():
    service, tickets = _service(SlowStore())
    token = b"remote-secret-0123456789"
    service.tenants = TenantDirectory([Tenant("remote", token_digest=_digest(token))])
    with pytest.raises(Unauthenticated, match=r"\.cred"):
        service.open_session("t", b"", unix_socket=True)
    with pytest.raises(Unauthenticated, match="token"):
        service.open_session("t", b"", unix_socket=False)
    remote = service.open_session("t", b"", unix_socket=False, token=token)
    assert remote.peer is None and remote.tenant == "remote" and not remote.admin
    layout = PoolLayout.staging(num_layers=1, num_pages=1, block_tokens=1, chunk_bytes=64)
    with pytest.raises(PermissionDenied, match="no peer credentials"):
        asyncio.run(service.register_shm_pool(remote.session_id, "x", 128, layout))
    # A peer that is in no tenant is refused, with what to do about it.
    with pytest.raises(PermissionDenied, match="belongs to no tenant"):
        service.open_session("t", tickets.issue(TicketKind.SESSION, PEER), unix_socket=True)


def test_given_up_tickets_end_only_the_session_each_opened_of_the_same_process():
    """An OpenSession naming the credential ticket of an OpenSession its client gave up
    before reading the session's id ends the session that ticket opened, on the terms of
    given_up_sessions: of the same pid and uid, and tenant; any other ticket (another
    process's, one that opened nothing, garbage) ends nothing."""
    service, tickets = _service(SlowStore())
    other = PeerCred(pid=2, uid=1000, gid=1000)
    mine, theirs, unspent = (tickets.issue(TicketKind.SESSION, p) for p in (PEER, other, PEER))
    given_up = service.open_session("t", mine, unix_socket=True).session_id
    kept = service.open_session("t", theirs, unix_socket=True).session_id
    named = [theirs, unspent, b"", b"x" * 40, mine[:31]]
    service.open_session(
        "t", tickets.issue(TicketKind.SESSION, PEER), unix_socket=True, given_up_tickets=named
    )
    assert service.sessions.find(given_up) is not None  # its ticket not named
    ended: list[str] = []
    service.open_session(
        "t",
        tickets.issue(TicketKind.SESSION, PEER),
        unix_socket=True,
        given_up_tickets=[*named, mine, mine],
        ended=ended.append,
    )
    assert ended == [given_up]
    assert service.sessions.find(given_up) is None
    assert service.sessions.find(kept) is not None
    # The ticket goes with its session: naming it again ends nothing.
    assert service.sessions.opened_by(ticket_digest(mine)) is None


def test_regression_a_given_up_ticket_named_before_its_opensession_ran_opened_a_session():
    """An OpenSession its client gave up before the daemon ran it (the request in flight on a
    channel an interrupt left locked, a busy daemon) can run after the client's next
    OpenSession named its ticket: that found no session to end, the client forgot the
    ticket, and the late OpenSession opened a session nobody could name, open until the
    process exited. A named ticket not yet spent is now spent there, so it opens nothing;
    another process's stays good."""
    service, tickets = _service(SlowStore())
    other = PeerCred(pid=2, uid=1000, gid=1000)
    late, theirs = tickets.issue(TicketKind.SESSION, PEER), tickets.issue(TicketKind.SESSION, other)
    service.open_session(
        "t",
        tickets.issue(TicketKind.SESSION, PEER),
        unix_socket=True,
        given_up_tickets=[late, theirs],
    )
    with pytest.raises(Unauthenticated):  # opened a session before
        service.open_session("t", late, unix_socket=True)
    assert service.open_session("t", theirs, unix_socket=True).peer == other
    assert len(tickets) == 0


def test_regression_a_session_could_hold_leases_without_bound():
    """Pinning lookups of the longest lease in a loop grew the daemon by every lease's refs
    (80 MB in 20 s from one client, up to gigabytes within lease_max_ms). A session now
    holds at most server.max_leases_per_session, counting the pinning lookups that awaited
    together, and gets a lease again once one ends."""

    async def run() -> None:
        store = SlowStore()
        store.release.set()
        config = load_config(None, ["server.max_leases_per_session=3"])
        service, tickets = _service(store, config)
        session = _open(service, tickets)
        keys = [bytes(32)] * 2
        leases = [(await service.lookup(session, keys, True, 0)).lease_id for _ in range(2)]
        store.release.clear()
        racing = [asyncio.ensure_future(service.lookup(session, keys, True, 0)) for _ in range(2)]
        await asyncio.sleep(0)
        store.release.set()
        outcomes = await asyncio.gather(*racing, return_exceptions=True)
        assert sum(isinstance(x, ResourceExhausted) for x in outcomes) == 1
        assert service.sessions.lease_count == 3 and store.pins == 3 * len(keys)
        with pytest.raises(ResourceExhausted, match=r"server\.max_leases_per_session"):
            await service.lookup(session, keys, True, 0)
        assert (await service.lookup(session, keys, False, 0)).prefix_len == 2  # no pin: served
        service.release(session, leases[0])
        assert (await service.lookup(session, keys, True, 0)).lease_id
        assert service.sessions.lease_count == 3

    asyncio.run(run())


def test_regression_a_tenants_sessions_together_could_hold_leases_without_bound():
    """server.max_leases_per_session bounds one session; a tenant opens up to
    server.max_sessions_per_tenant (256) of them, and pinning lookups of 4,096 keys in each
    made the daemon hold up to 256 x 16,384 leases of 32 KiB of refs: 128 GiB for one
    tenant (one session's 4,000 such leases, taken in 24 s: +136 MB of RSS). The leases of one
    tenant's sessions together now hold at most server.max_lease_bytes_per_tenant, counted
    per lease as sessions.lease_bytes; another tenant still pins, and what a lease's end
    gives back can be leased again."""

    async def run() -> None:
        store = SlowStore()
        store.release.set()
        keys = [bytes(32)] * 100  # SlowStore finds 100 blocks
        cost = lease_bytes(100)
        config = load_config(None, [f"server.max_lease_bytes_per_tenant={3 * cost}"])
        service, tickets = _service(store, config)
        first, second = _open(service, tickets), _open(service, tickets)
        other = service.open_session(
            "o",
            tickets.issue(TicketKind.SESSION, PeerCred(pid=2, uid=2000, gid=2000)),
            unix_socket=True,
        ).session_id
        held = [(await service.lookup(first, keys, True, 0)).lease_id for _ in range(2)]
        held.append((await service.lookup(second, keys, True, 0)).lease_id)
        for session in (first, second):  # under its own session limit, not its tenant's
            with pytest.raises(ResourceExhausted, match=r"server\.max_lease_bytes_per_tenant"):
                await service.lookup(session, keys, True, 0)
        assert store.pins == 3 * 100 and service.sessions.lease_count == 3
        assert (await service.lookup(first, keys, False, 0)).prefix_len == 100  # no pin
        assert (await service.lookup(other, keys, True, 0)).lease_id  # another tenant's
        service.release(first, held[0])
        assert (await service.lookup(second, keys, True, 0)).lease_id
        service.close_session(first)  # its leases end with it
        assert service.sessions.tenant_lease_bytes(f"uid:{PEER.uid}") == 2 * cost
        assert (await service.lookup(second, keys, True, 0)).lease_id
        service.close_session(second)
        service.close_session(other)
        assert service.sessions.per_tenant_lease_bytes() == {} and store.pins == 0

    asyncio.run(run())


def test_regression_expired_leases_the_sweep_had_not_reached_counted_toward_the_lease_limit():
    """A lease past its expiry stays in its session until the lease reaper's next pass
    (every 0.25 s) and counted toward server.max_leases_per_session meanwhile: a client that
    let its leases expire, as it may, was refused RESOURCE_EXHAUSTED while holding no live
    lease. At the limit, expired leases are now released first, as the reaper releases them,
    and each pin is released exactly once, whichever of the limit, the reaper or a Release
    comes to an expired lease later."""

    async def run() -> None:
        store = SlowStore()
        store.release.set()
        now = [100.0]
        config = load_config(None, ["server.max_leases_per_session=2"])
        service, tickets = _service(store, config, clock=lambda: now[0])
        session = _open(service, tickets)
        keys = [bytes(32)] * 3
        short = (await service.lookup(session, keys, True, 1000)).lease_id
        long = (await service.lookup(session, keys, True, 60_000)).lease_id
        now[0] += 2.0  # the short lease expired; the reaper has not run
        fresh = (await service.lookup(session, keys, True, 1000)).lease_id
        assert fresh and service.sessions.lease_count == 2 and store.pins == 2 * len(keys)
        assert store.counters.get("leases_expired") == 1
        with pytest.raises(NotFound):  # released once, by the limit: not again
            service.release(session, short)
        assert service.expire_leases() == 0 and store.pins == 2 * len(keys)
        with pytest.raises(ResourceExhausted):  # both leases live: the limit holds
            await service.lookup(session, keys, True, 1000)
        now[0] += 2.0  # fresh expired too; the reaper comes first this time
        assert service.expire_leases() == 1 and store.pins == len(keys)
        with pytest.raises(NotFound):
            service.release(session, fresh)
        service.release(session, long)
        assert store.pins == 0 and service.sessions.lease_count == 0
        assert store.counters.get("leases_expired") == 2

    asyncio.run(run())


def test_regression_leases_ending_together_were_unpinned_one_store_call_each():
    """Leases that expire at one deadline, or end with their session, were unpinned one store
    call each (tens of microseconds): a tenant's 40,000 leases expiring together held the
    event loop 1.2 s, its client holding as many killed 0.7 s, every other client's calls
    waiting. They are unpinned in one call now."""

    async def run() -> None:
        store = SlowStore()
        store.release.set()
        now = [100.0]
        service, tickets = _service(store, clock=lambda: now[0])
        session = _open(service, tickets)
        keys = [bytes(32)] * 3
        for _ in range(100):
            await service.lookup(session, keys, True, 1000)
        now[0] += 2.0
        assert service.expire_leases() == 100
        assert store.pins == 0 and store.unpin_calls == 1
        for _ in range(100):
            await service.lookup(session, keys, True, 60_000)
        service.close_session(session)
        assert store.pins == 0 and store.unpin_calls == 2

    asyncio.run(run())


def test_regression_a_session_closing_gave_back_all_of_its_pins_in_one_step(monkeypatch):
    """A session's close gave back the pins of all of its leases in one step of the event
    loop: a tenant's leases may pin some 7.3 million refs (server.max_lease_bytes_per_tenant),
    and giving them back held every other client's calls 0.9-1.2 s. UNPIN_SLICE_REFS go back
    in the close's step and as many at each turn after it (expired leases likewise); a Check
    meanwhile counts the pins still owed and finds nothing wrong."""
    monkeypatch.setattr(service_module, "UNPIN_SLICE_REFS", 100)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            keys, admin = await _put_blocks(service, session, pool)

            def pins() -> int:
                return int(store.table.pins.sum())

            async def pin_ten_times() -> str:
                user = _open(service, service.tickets)
                for _ in range(10):  # 1,280 pins of the 128 blocks
                    await service.lookup(user, keys, True, 60_000)
                assert pins() == 1280
                return user

            service.close_session(await pin_ten_times())
            seen = [pins()]
            while seen[-1]:
                await asyncio.sleep(0)
                seen.append(pins())
            assert seen[0] == 1180 and (-np.diff(seen)).max() == 100, seen
            owed_at_check: list[int] = []
            owed_unpins = service.owed_unpins

            def counted_owed() -> np.ndarray:
                owed = owed_unpins()
                owed_at_check.append(len(owed))
                return owed

            service.owed_unpins = counted_owed  # type: ignore[method-assign]
            service.close_session(await pin_ten_times())
            assert (await service.check(admin)).problems == []
            assert owed_at_check[0] > 0, owed_at_check
            while pins():
                await asyncio.sleep(0)

    asyncio.run(run())


def _pin_books(
    store: BlockStore, service: KVService
) -> tuple[Callable[[], int], Callable[[], bool]]:
    """(how many pins ended leases still owe, whether the table's pins are the live leases'
    plus those owed, none below zero: what Check compares)."""

    def owed() -> int:
        return len(service.owed_unpins())

    def balanced() -> bool:
        leased = sum(len(x.refs) for x in service.sessions.leases())
        pins = store.table.pins
        return int(pins.sum()) == leased + owed() and bool((pins >= 0).all())

    return owed, balanced


async def _close_pinning(service: KVService, keys: list[bytes], times: int) -> None:
    """A new session pins ``keys`` ``times`` times over (a lease each), and closes."""
    user = _open(service, service.tickets)
    for _ in range(times):
        await service.lookup(user, keys, True, 60_000)
    service.close_session(user)


def _loop_failures(main: Callable[[], Awaitable[None]]) -> list[dict]:
    """Run ``main()`` on a new event loop; what reached the loop's exception handler (the
    callbacks that raised)."""
    failures: list[dict] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: failures.append(ctx))
        await main()

    asyncio.run(run())
    return failures


def test_regression_a_small_lease_ending_behind_owed_pins_kept_its_blocks_pinned(monkeypatch):
    """While a closed session's pins went back UNPIN_SLICE_REFS a turn, every lease that ended
    meanwhile, however small and whoever's, was queued behind them: another tenant's lease
    that expired, or its session that closed, kept its blocks pinned (a Delete found them
    busy, the hint budget charged) until the whole backlog was given back, up to ~112 turns
    of the loop at a tenant's 7.3 M refs. What fits one slice goes back at once, as it does
    with nothing owed. The owed pins are pins meanwhile: their blocks are busy, a pinning
    Lookup of them and its Release add and take their own, and the table's pins are at every
    step the live leases' plus those owed (what Check compares)."""
    monkeypatch.setattr(service_module, "UNPIN_SLICE_REFS", 10)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            keys, admin = await _put_blocks(service, session, pool)
            owed, balanced = _pin_books(store, service)
            closing, other, small = (_open(service, service.tickets) for _ in range(3))
            for _ in range(20):  # 1,280 pins of 64 blocks, given back 10 a turn
                await service.lookup(closing, keys[:64], True, 60_000)
            expiring = await service.lookup(other, keys[64:68], True, 1_000)
            await service.lookup(small, keys[68:72], True, 60_000)
            service.close_session(closing)
            assert owed() == 1270 and balanced()
            again = await service.lookup(other, keys[:4], True, 60_000)
            service.release(other, again.lease_id)
            assert balanced()
            before = owed()
            assert service.expire_leases(time.monotonic() + 30) == 1
            service.close_session(small)
            assert service.sessions.lease_for(other, expiring.lease_id) is None
            assert owed() == before and balanced()
            assert (await service.delete(admin, keys[64:72])).deleted == 8
            assert (await service.delete(admin, keys[:4])).busy == 4
            assert (await service.check(admin)).problems == []
            while owed():
                await asyncio.sleep(0)
                assert balanced()
            assert int(store.table.pins.sum()) == 0
            assert (await service.delete(admin, keys[:4])).deleted == 4
            assert (await service.check(admin)).problems == []

    asyncio.run(run())


def test_a_session_closing_in_turns_meets_new_sessions_deletes_and_the_stop(monkeypatch):
    """Between the turns of a close whose pins are owed (UNPIN_SLICE_REFS a turn), a new
    session of the same tenant pins the same blocks, releases and closes (its pins owed
    behind the first backlog), a Delete finds the owed blocks busy and deletes those no
    lease holds, and the store stops with pins still owed: at every turn the table's pins
    are the live leases' plus those owed, each pin goes back once (none below zero), and no
    slice fails (the store's unpin raises where a count would go below zero, and the
    failure is counted), after the stop either."""
    monkeypatch.setattr(service_module, "UNPIN_SLICE_REFS", 10)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            keys, admin = await _put_blocks(service, session, pool)
            owed, balanced = _pin_books(store, service)
            await _close_pinning(service, keys[:64], 20)  # 1,280 pins, given back 10 a turn
            assert owed() == 1270 and balanced()
            await asyncio.sleep(0)
            second = _open(service, service.tickets)  # the same tenant's
            held = await service.lookup(second, keys[:64], True, 60_000)
            for _ in range(3):
                await service.lookup(second, keys[:64], True, 60_000)
            service.release(second, held.lease_id)
            assert balanced()
            service.close_session(second)  # 192 more, behind the first backlog
            assert owed() > 1192 and balanced()
            assert (await service.delete(admin, keys[:8])).busy == 8
            assert (await service.delete(admin, keys[120:])).deleted == 8
            assert (await service.check(admin)).problems == []
            for _ in range(20):
                await asyncio.sleep(0)
                assert balanced()
            assert owed() > 0
            await _close_pinning(service, keys[:64], 2)
            await store.stop(flush=False)
        assert owed() > 0  # the store closed with pins owed
        while owed():
            await asyncio.sleep(0)
            assert (store.table.pins >= 0).all()
        assert int(store.table.pins.sum()) == 0
        assert store.counters.get("background_errors") == 0

    assert _loop_failures(run) == []


def test_regression_a_slice_of_owed_pins_that_failed_left_the_rest_pinned(monkeypatch, caplog):
    """A slice of owed pins whose give-back raised (the store's unpin asserts that no pinned
    block was freed and no count goes below zero) went to the event loop's handler: not
    counted in background_errors, and the rest of the backlog stayed pinned (its blocks busy
    to a Delete, the hint budget charged) until some later ending owed pins again. The
    failure is logged and counted, as the lease reaper's are, and the rest go back on at
    the next turn (not ``loops.TURN_RETRY_S`` later: the failed slice is done with)."""
    monkeypatch.setattr(service_module, "UNPIN_SLICE_REFS", 100)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            keys, admin = await _put_blocks(service, session, pool)
            owed, _ = _pin_books(store, service)
            unpin, calls = store.unpin, [0]

            def third_fails(refs: np.ndarray, *, distinct: bool = True) -> None:
                calls[0] += 1
                if calls[0] == 3:
                    raise AssertionError("pin count went below zero: a lease was released twice")
                unpin(refs, distinct=distinct)

            monkeypatch.setattr(store, "unpin", third_fails)  # a lookup's pins call it not
            await _close_pinning(service, keys, 10)  # 1,280 pins of the 128 blocks
            for _ in range(20):
                await asyncio.sleep(0)
            assert owed() == 0
            assert int(store.table.pins.sum()) == 100  # the failed slice's: that unpin took none
            assert store.counters.get("background_errors") == 1
            problems = (await service.check(admin)).problems
            assert any("pin counts differ from their live leases" in x for x in problems)

    with caplog.at_level(logging.ERROR, logger=service_module.log.name):
        assert _loop_failures(run) == []
    assert "giving back 100 pins owed by ended leases failed" in caplog.text
    assert "tried again" not in caplog.text


def test_regression_a_slice_of_owed_pins_that_raised_in_its_take_kept_the_backlog_pinned(
    monkeypatch,
):
    """A slice of owed pins took its refs off the queue before the try around the store's
    unpin: an exception there (a MemoryError as it split a lease's refs) went to the event
    loop's handler, uncounted, the refs it had taken off were lost, and no turn was
    scheduled for the rest: the closed session's blocks stayed pinned for good (busy to a
    Delete, never evicted). The slice is taken off only once made, and a failed turn is
    logged, counted and tried again: every pin goes back once."""
    monkeypatch.setattr(service_module, "UNPIN_SLICE_REFS", 100)
    monkeypatch.setattr(loops, "TURN_RETRY_S", 0.0)

    class SplitFails(np.ndarray):
        """Refs whose first split (``refs[a:b]``) raises."""

        failed = False

        def __getitem__(self, key: object) -> object:
            if isinstance(key, slice) and not SplitFails.failed:
                SplitFails.failed = True
                raise MemoryError("injected")
            return super().__getitem__(key)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            keys, admin = await _put_blocks(service, session, pool)
            owed, balanced = _pin_books(store, service)
            await _close_pinning(service, keys, 10)  # 1,280 pins, 128 a lease, 100 a turn
            # The next slice takes the first lease's last 28 and splits the second lease's.
            queue = service._owed_unpins
            assert [len(x) for x in queue][:2] == [28, 128]
            queue[1] = queue[1].view(SplitFails)
            for _ in range(20):
                await asyncio.sleep(0)
            assert SplitFails.failed
            assert owed() == 0 and balanced()
            assert int(store.table.pins.sum()) == 0
            assert (await service.delete(admin, keys)).deleted == 128
            assert (await service.check(admin)).problems == []
            assert store.counters.get("background_errors") == 1

    assert _loop_failures(run) == []


@pytest.mark.parametrize("fault", ["given back twice", "freed while pinned"])
def test_regression_a_failed_slice_of_owed_pins_drove_counts_below_zero_or_kept_the_rest(
    monkeypatch, fault
):
    """The store's unpin, finding a pin it could not take (its block's count already at zero:
    a lease given back twice; its block freed while pinned), raised after taking every pin
    of the call (counts left below zero: the block's next lease did not keep it from
    eviction or a Delete) or before taking any (the slice's other pins, up to
    UNPIN_SLICE_REFS of other leases, held for good: nothing owed them any more). The pins
    that can be taken are, those that cannot are counted in the error, and no count goes
    below zero, and the rest go back on at the next turn."""
    monkeypatch.setattr(service_module, "UNPIN_SLICE_REFS", 100)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            keys, admin = await _put_blocks(service, session, pool)
            owed, _ = _pin_books(store, service)
            await _close_pinning(service, keys, 10)  # 1,280 pins of the 128 blocks
            ref = service.owed_unpins()[28]  # keys[0]'s block, owed by 9 leases
            bid = int(ref) & 0xFFFFFFFF
            if fault == "given back twice":
                store.unpin(np.full(9, ref), distinct=False)
            else:  # a removal that overlooked its pins
                store.table.pins[bid] = 0
                assert (await service.delete(admin, keys[:1])).deleted == 1
            for _ in range(20):  # 1,180 owed, 100 a turn
                await asyncio.sleep(0)
                assert (store.table.pins >= 0).all()
            assert owed() == 0
            assert int(store.table.pins.sum()) == 0  # none held for good
            assert store.counters.get("background_errors") == 9  # a slice per lease of 128

    assert _loop_failures(run) == []


def test_regression_leases_expiring_together_were_released_in_one_step_of_the_event_loop():
    """A tenant's leases that expired together (some 130,000 under the default
    server.max_lease_bytes_per_tenant) were all released in one step of the event loop, by
    the reaper's pass or by whichever call came first that released the leases past their
    deadline (a Release, a Get under a lease, a pinning Lookup at a limit): 0.6-1.4 s of
    every other client's calls waiting. The reaper releases them EXPIRY_SLICE_LEASES a step,
    a call at a limit one slice, and a call naming a lease that lease alone."""

    async def run() -> None:
        n = 2 * EXPIRY_SLICE_LEASES + 5
        store, service, tickets, now = _leasing(n)
        session = _open(service, tickets)
        keys = [bytes(32)]
        leases = [(await service.lookup(session, keys, True, 1000)).lease_id for _ in range(n)]
        now[0] += 2.0  # all of them past their deadline; the reaper has not run
        assert (await service.lookup(session, keys, True, 60_000)).lease_id  # at the limit
        left = n - EXPIRY_SLICE_LEASES
        assert service.sessions.lease_count == left + 1
        due = [x for x in leases if x in {x.lease_id for x in service.sessions.leases()}]
        with pytest.raises(NotFound):  # past its deadline: released, that one only
            service.release(session, due[0])
        assert service.sessions.lease_count == left
        assert service._lease_for(session, due[1]) is None  # a Get's, likewise
        assert service.sessions.lease_count == left - 1
        reaped, counts = await _each_step(
            lambda: service.sessions.lease_count, service.reap_leases()
        )
        assert reaped == left - 2
        assert counts[0] == left - 1 and counts[-1] == 1  # the live lease stays
        assert (-np.diff(counts)).max() <= EXPIRY_SLICE_LEASES
        assert store.pins == 1
        assert store.counters.get("leases_expired") == n

    asyncio.run(run())


def test_regression_released_leases_past_their_deadline_were_popped_in_one_slice():
    """A slice of lease expiry (EXPIRY_SLICE_LEASES) counted only the live leases it released:
    the expiry heap's entries of leases released before their deadline, which stay there
    until it comes up (up to twice the live leases and 1,024 before a Release compacts it),
    were all popped in the reaper's first step, however many. A tenant that took 129,000
    leases of one deadline and released them, while it or another held as many longer ones,
    had that step pop 129,000 entries: the stall the slices end. A slice now pops at most
    EXPIRY_SLICE_LEASES entries, live or released."""

    async def run() -> None:
        n = 3 * EXPIRY_SLICE_LEASES
        store, service, tickets, now = _leasing(2 * n)
        session = _open(service, tickets)
        keys = [bytes(32)]
        for _ in range(n):
            await service.lookup(session, keys, True, 60_000)
        due = [(await service.lookup(session, keys, True, 1000)).lease_id for _ in range(n)]
        for lease_id in due:
            service.release(session, lease_id)
        assert len(service.sessions._expiry) == 2 * n  # not compacted: n live, 2n entries
        now[0] += 2.0
        reaped, sizes = await _each_step(
            lambda: len(service.sessions._expiry), service.reap_leases()
        )
        assert reaped == 0
        assert sizes[0] == 2 * n and sizes[-1] == n
        assert (-np.diff(sizes)).max() <= EXPIRY_SLICE_LEASES
        assert service.sessions.lease_count == n and store.pins == n

    asyncio.run(run())


def test_regression_a_reaper_pass_took_leases_coming_due_during_it_and_might_never_end():
    """The reaper's pass released leases while any was past its deadline, reading the clock
    at each slice: leases coming due during it joined it, and had more than
    EXPIRY_SLICE_LEASES expiry entries come due each turn of the event loop, the pass never
    ended and the reaper never went on to expire tickets. A pass now ends at the entries due
    when it began; those due since wait for the next."""

    async def run() -> None:
        n = 2 * EXPIRY_SLICE_LEASES
        store, service, tickets, now = _leasing(2 * n)
        session = _open(service, tickets)
        keys = [bytes(32)]
        for _ in range(n):  # due at 101.0
            await service.lookup(session, keys, True, 1000)
        now[0] = 100.5
        for _ in range(n):  # due at 101.5
            await service.lookup(session, keys, True, 1000)
        now[0] = 101.2

        async def later() -> None:  # runs at the pass's first turn of the event loop
            now[0] = 102.0  # the second lot comes due while the pass runs

        clock = asyncio.ensure_future(later())
        assert await service.reap_leases() == n
        await clock
        assert service.sessions.lease_count == n
        assert await service.reap_leases() == n  # the next pass
        assert service.sessions.lease_count == 0 and store.pins == 0

    asyncio.run(run())


def test_regression_another_tenants_lease_past_its_deadline_was_permission_denied():
    """A Release or a Get naming another tenant's lease past its deadline answered NotFound,
    as for any lease gone (all leases past their deadline were released before the lease
    was looked up); once only the lease named was released (081e347), it was looked up
    first, still live, and the Release and the Get were PERMISSION_DENIED until the reaper
    came to it: what a call naming a lease got depended on the reaper's timing again. The
    lease is released at its deadline first, as before."""

    async def run() -> None:
        store = SlowStore()
        store.release.set()
        now = [100.0]
        tickets = TicketBook(FdCloser())
        tenants = TenantDirectory(
            [Tenant("alice", uids=frozenset({PEER.uid})), Tenant("bob", uids=frozenset({2000}))]
        )
        service = KVService(
            Config(),
            store,  # type: ignore[arg-type]
            PoolRegistry("/dev/shm"),
            SessionRegistry(),
            tickets,
            tenants,
            clock=lambda: now[0],
        )
        alice = _open(service, tickets)
        bob = service.open_session(
            "b", tickets.issue(TicketKind.SESSION, PeerCred(2, 2000, 2000)), unix_socket=True
        ).session_id
        keys = [bytes(32)]
        leases = [(await service.lookup(alice, keys, True, 1000)).lease_id for _ in range(2)]
        with pytest.raises(PermissionDenied):  # live: another tenant's
            service.release(bob, leases[0])
        now[0] += 2.0  # both past their deadline; the reaper has not run
        with pytest.raises(NotFound):
            service.release(bob, leases[0])
        assert service._lease_for(bob, leases[1]) is None  # a Get's: loads unleased
        assert service.sessions.lease_count == 0 and store.pins == 0
        assert store.counters.get("leases_expired") == 2

    asyncio.run(run())


def test_regression_a_lookup_at_its_limit_was_refused_behind_another_tenants_expired_leases():
    """At a lease limit, a pinning Lookup released one slice of the leases past their
    deadline (081e347), earliest first, whoever's: behind more than a slice of another
    tenant's, a session whose every lease was past its deadline was RESOURCE_EXHAUSTED until
    the reaper's pass came to its own, where "only live leases count". The Lookup now
    releases a slice a turn of the event loop until its lease fits or none is past its
    deadline; a limit that live leases fill still refuses."""

    async def run() -> None:
        n = 2 * EXPIRY_SLICE_LEASES
        store, service, tickets, now = _leasing(n)
        alice = _open(service, tickets)
        bob = service.open_session(
            "b", tickets.issue(TicketKind.SESSION, PeerCred(2, 2000, 2000)), unix_socket=True
        ).session_id
        keys = [bytes(32)]
        for _ in range(n):
            await service.lookup(bob, keys, True, 1000)
        now[0] += 0.5
        for _ in range(n):
            await service.lookup(alice, keys, True, 1000)
        with pytest.raises(ResourceExhausted):  # live: the limit holds
            await service.lookup(alice, keys, True, 1000)
        now[0] += 2.0  # all past their deadline, bob's first; the reaper has not run
        lookup = service.lookup(alice, keys, True, 60_000)
        outcome, counts = await _each_step(lambda: service.sessions.lease_count, lookup)
        assert outcome.lease_id
        assert (-np.diff(counts)).max() <= EXPIRY_SLICE_LEASES  # a slice a step
        left = n - EXPIRY_SLICE_LEASES  # bob's two slices, then one of alice's: it fits
        assert service.sessions.lease_count == left + 1 and store.pins == left + 1
        assert await service.reap_leases() == left
        assert service.sessions.lease_count == 1 and store.pins == 1
        assert store.counters.get("leases_expired") == 2 * n

    asyncio.run(run())


def test_regression_a_lookup_at_a_limit_pinned_blocks_deleted_while_it_released_leases():
    """A pinning Lookup whose blocks passed its tenant's lease bytes only once found released
    the leases past their deadline a slice a turn of the event loop (76ad767) between the
    store's answer and the pin: a Delete that ran in such a turn freed a row found, and the
    Lookup then pinned the freed row (its lease's Release failed: "a pinned block was
    freed"). The leases past their deadline are released before the store is asked, for as
    many blocks as the Lookup names; after the answer, the check and the pin are one step."""

    async def run() -> None:
        # One lease of a block, past its deadline, and a pinning Lookup's of none fit;
        # of one more block, not.
        cap = f"server.max_lease_bytes_per_tenant={lease_bytes(1) + lease_bytes(0)}"
        async with _putting_session([cap], 2) as (store, service, session, pool):
            now = [100.0]
            service._clock = lambda: now[0]
            keys, admin = await _put_blocks(service, session, pool, 2)
            assert (await service.lookup(session, keys[:1], True, 1000)).lease_id
            now[0] += 2.0
            deleted: list[int] = []

            async def delete_once_leases_go() -> None:
                while service.sessions.lease_count:
                    await asyncio.sleep(0)
                deleted.append((await service.delete(admin, keys[1:])).deleted)

            deleter = asyncio.ensure_future(delete_once_leases_go())
            outcome = await service.lookup(session, keys[1:], True, 60_000)
            await deleter
            assert outcome.lease_id or outcome.prefix_len == 0
            assert deleted == [1 - bool(outcome.lease_id)]  # a pinned block stays
            assert store.check() == []
            if outcome.lease_id:
                service.release(session, outcome.lease_id)  # AssertionError before
            assert int(store.table.pins.sum()) == 0

    asyncio.run(run())


def test_leases_of_one_block_ending_together_give_back_each_pin_and_the_budget_charge():
    """The one call that unpins many leases (see above) takes as many pins off a block as
    leases pinned it, and the block's charge against its tenant's hint budget goes back
    once, with the last."""

    async def run() -> None:
        now = [100.0]
        async with _putting_session(["tenants=[{name: a, uids: [1000]}]"], 2) as opened:
            store, service, session, pool = opened
            service._clock = lambda: now[0]
            keys = [bytes(range(32)), bytes(range(1, 33))]
            results, _ = await service.put(session, pool, keys, [0, 1], b"")
            assert (results == PutResult.STORED).all()
            for _ in range(3):
                await service.lookup(session, keys, True, 1000)
            await service.lookup(session, keys[:1], True, 60_000)
            budget = store.hint_budget
            assert budget is not None and budget.charged_total(time.monotonic()) > 0
            assert int(store.table.pins.sum()) == 3 * 2 + 1
            now[0] += 2.0
            assert service.expire_leases() == 3
            assert int(store.table.pins.sum()) == 1  # the long lease's
            charged = budget.charged_total(time.monotonic())
            assert charged == store.table.nbytes[store.table.pins > 0].sum()
            service.close_session(session)
            assert int(store.table.pins.sum()) == 0
            assert budget.charged_total(time.monotonic()) == 0
            assert store.check() == []

    asyncio.run(run())


def test_regression_a_lease_past_its_deadline_served_until_the_reaper_came():
    """A lease past its deadline stayed in force until the reaper's next pass (every 0.25 s):
    a Release of it succeeded, and a Get under it was counted as its pinning Lookup's
    access (no touch), where a moment later the lease was gone (NotFound; a Get of its own).
    It is now gone at its deadline: either call releases it first, as the reaper would."""

    async def run() -> None:
        store = SlowStore()
        store.release.set()
        now = [100.0]
        service, tickets = _service(store, clock=lambda: now[0])
        session = _open(service, tickets)
        layout = PoolLayout.staging(num_layers=1, num_pages=2, block_tokens=1, chunk_bytes=4096)
        fd = os.memfd_create("kvtier-test")
        try:
            os.ftruncate(fd, layout.extent_bytes)
            os.posix_fallocate(fd, 0, layout.extent_bytes)
            pool = await service.pools.register_fd(session, fd, layout.extent_bytes, layout)
            keys = [bytes(32)]
            for call in ("release", "get"):
                lease = (await service.lookup(session, keys, True, 1000)).lease_id
                await service.get(session, pool.pool_id, keys, [0], lease)
                assert store.touched[-1] is False  # live: the lookup's access
                now[0] += 1.0  # at its deadline; the reaper has not run
                if call == "release":
                    with pytest.raises(NotFound, match="does not exist"):
                        service.release(session, lease)
                else:
                    await service.get(session, pool.pool_id, keys, [0], lease)
                    assert store.touched[-1] is True  # an access of its own
                assert store.pins == 0 and service.sessions.lease_count == 0
                assert service.expire_leases() == 0  # the reaper finds nothing left
            assert store.counters.get("leases_expired") == 2
        finally:
            os.close(fd)
            service.close_session(session)

    asyncio.run(run())


def test_regression_logs_showed_whole_session_ids_which_let_their_readers_act_as_the_session(
    caplog,
):
    """A session id is all a request needs to act as its session, from any connection (over
    TCP too, by another tenant's client). The daemon logged the whole id of every session it
    opened and of every session whose pool broke, so whoever read its log could act as any
    live session, an admin's included. Only the first characters are logged now."""
    service, tickets = _service(SlowStore())
    with caplog.at_level(logging.INFO, logger="kvtier.daemon"):
        session = _open(service, tickets)
        layout = PoolLayout.staging(num_layers=1, num_pages=1, block_tokens=1, chunk_bytes=64)
        fd = os.memfd_create("kvtier-test")
        try:
            os.ftruncate(fd, layout.extent_bytes)
            os.posix_fallocate(fd, 0, layout.extent_bytes)
            pool = asyncio.run(service.pools.register_fd(session, fd, layout.extent_bytes, layout))
        finally:
            os.close(fd)
        pool.broken = "a test says so"
        pool.on_fault(pool)  # what a copy that faults in the pool's memory calls
        service.close_session(session)
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"session {session[:8]} opened" in x for x in lines), lines
    assert any(f"of session {session[:8]} is broken" in x for x in lines), lines
    assert any(f"session {session[:8]} closed" in x for x in lines), lines
    assert not [x for x in lines if session in x]


def test_regression_a_put_that_waited_for_a_failed_owner_record_bound_past_the_namespace_limit():
    """A put to a namespace whose owner another put is recording waits for that record; when
    the record failed, the namespace was unbound and the waiter bound it again without the
    tenant's namespace limit being checked, though another put had meanwhile taken the room
    the failure left: the tenant held two namespaces under server.max_namespaces_per_tenant=1.
    The limit is checked when a namespace is bound, after any wait."""
    seg = 64 * 1024

    async def run() -> None:
        config = load_config(None, ["server.max_namespaces_per_tenant=1"])
        l2 = MemoryTier(TierKind.DISK, 4 * seg, seg, persistent=True)
        store = BlockStore(config, tiers=[HostArena(seg, seg), l2])
        entered, release, calls = threading.Event(), threading.Event(), []
        remember = l2.remember_namespace

        def failing_once(ns: int, label: str) -> None:
            calls.append(ns)
            if len(calls) == 1:
                entered.set()
                release.wait(30)
                raise OSError("index unwritable")
            remember(ns, label)

        l2.remember_namespace = failing_once  # type: ignore[method-assign]
        try:
            service, tickets = _service(store, config)
            session = service.sessions.get(_open(service, tickets))
            a, b = (service.tenants.space(session.tenant, name) for name in ("a", "b"))
            first = asyncio.ensure_future(service._bind(session, a))
            while not entered.is_set():
                await asyncio.sleep(0.001)
            waiting = asyncio.ensure_future(service._bind(session, a))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not waiting.done()
            release.set()
            with pytest.raises(OSError):
                await first
            # The failure left the room; the waiter has not taken it yet, another put does.
            assert a.ns not in store.ns_owner and not waiting.done()
            await service._bind(session, b)
            with pytest.raises(ResourceExhausted, match=r"server\.max_namespaces_per_tenant"):
                await waiting
            owner = store.owners[session.tenant]
            assert [ns for ns, o in store.ns_owner.items() if o == owner] == [b.ns]
        finally:
            await store.stop(flush=False)
            store.close()

    asyncio.run(run())


def test_regression_blocks_a_lookup_found_in_l3_were_indexed_as_the_default_tenant_s():
    """A Lookup that finds blocks only in a key-addressed tier (L3: stored there by another
    node, or before a restart) indexes them. They were indexed as the default tenant's, not
    as the tenant whose namespace holds them: once a Get promoted them into L1, they counted
    to the default tenant's usage there, and to no quota of their own tenant's."""
    seg = 64 * 1024

    async def run() -> None:
        config = Config()
        shared = MemoryKeyTier()
        store = BlockStore(config, tiers=[HostArena(seg, seg), shared])
        tenants = TenantDirectory([Tenant("alice", uids=frozenset({PEER.uid}))])
        tickets = TicketBook(FdCloser())
        service = KVService(
            config, store, PoolRegistry("/dev/shm"), SessionRegistry(), tickets, tenants
        )
        service.apply_quotas()
        session = _open(service, tickets)
        layout = PoolLayout.staging(
            num_layers=1, num_pages=8, block_tokens=1, chunk_bytes=4096, kv_count=1
        )
        keys = [os.urandom(32) for _ in range(4)]
        ns = service.tenants.space("alice", "").ns
        blocks = [BlockRef(ns, k) for k in keys]
        await shared.write(blocks, 4096, HostBuffers([memoryview(bytes(4096))] * 4))
        fd = os.memfd_create("kvtier-test")
        try:
            os.ftruncate(fd, layout.extent_bytes)
            os.posix_fallocate(fd, 0, layout.extent_bytes)
            pool = await service.pools.register_fd(session, fd, layout.extent_bytes, layout)
            assert (await service.lookup(session, keys, False, 0)).prefix_len == 4
            loaded = await service.get(session, pool.pool_id, keys, [0, 1, 2, 3], 0)
            assert loaded.tolist() == [True] * 4
            ids = store.table.lookup(ns, keys_to_words(keys))
            assert (store.table.owner[ids] == store.owners["alice"]).all()
            l1 = {u.tenant: u.tiers[0].used_bytes for u in service.tenant_usage()}
            # The default owner (no tenant here) holds nothing, so it is not listed.
            assert l1 == {"alice": 4 * 4096}
        finally:
            os.close(fd)
            service.close_session(session)
            await store.stop(flush=False)
            store.close()

    asyncio.run(run())


def test_a_namespace_whose_blocks_all_left_the_store_stops_counting_toward_the_limit():
    """A namespace counts toward ``server.max_namespaces_per_tenant`` while the store holds
    blocks of it. It counted for the life of the daemon (and past restarts, since the disk
    tier records it): a tenant that had stored into as many namespaces as the limit, one model
    or adapter after another, was refused every new one long after the old ones' blocks were
    all gone. A namespace that still holds a block keeps counting; a session that bound a
    namespace since released binds it again (and is counted) before storing there."""

    async def run() -> None:
        opened = _putting_session(["server.max_namespaces_per_tenant=1"], 8)
        async with opened as (store, service, session, pool_id):
            key_a, key_b, key_c = os.urandom(32), os.urandom(32), os.urandom(32)
            stored, _ = await service.put(session, pool_id, [key_a], [0], b"", namespace="a")
            assert stored.tolist() == [PutResult.STORED]
            # "a" holds a block: "b" is refused, and "a" stays bound.
            with pytest.raises(ResourceExhausted, match=r"server\.max_namespaces_per_tenant"):
                await service.put(session, pool_id, [key_b], [1], b"", namespace="b")
            # Once "a" holds nothing, "b" takes its place.
            assert (await service.delete(session, [key_a], namespace="a")).deleted == 1
            stored, _ = await service.put(session, pool_id, [key_b], [1], b"", namespace="b")
            assert stored.tolist() == [PutResult.STORED]
            owner = store.owners[service.sessions.get(session).tenant]
            bound = [ns for ns, o in store.ns_owner.items() if o == owner]
            assert bound == [service._space(service.sessions.get(session), "b").ns]
            # The session had bound "a" before: it is counted again, so refused while "b"
            # holds a block.
            with pytest.raises(ResourceExhausted, match=r"server\.max_namespaces_per_tenant"):
                await service.put(session, pool_id, [key_c], [2], b"", namespace="a")
            assert store.table.ns_blocks == {bound[0]: 1}

    asyncio.run(run())


def test_regression_a_session_kept_every_namespace_it_had_ever_bound():
    """A session remembers the namespaces it bound for its puts (one bind each, not one per
    put), and remembered them all for its life: a tenant that stored into and emptied one
    namespace after another (the limit unbinds empty ones) grew the daemon by about 500 bytes
    per namespace without bound (20,000 in one session: +10 MB). Entries the store no longer
    binds are dropped as new ones come, so a session holds about as many as the limit."""
    limit = 4

    async def run() -> None:
        opened = _putting_session([f"server.max_namespaces_per_tenant={limit}"], 1)
        async with opened as (store, service, session, pool_id):
            key = os.urandom(32)
            for i in range(10 * limit):
                stored, _ = await service.put(session, pool_id, [key], [0], b"", namespace=f"m{i}")
                assert stored.tolist() == [PutResult.STORED]
                assert (await service.delete(session, [key], namespace=f"m{i}")).deleted == 1
            assert len(service.sessions.get(session).bound) <= 2 * limit
            # The last one is still bound; storing there again needs no new bind.
            await service.put(session, pool_id, [key], [0], b"", namespace=f"m{10 * limit - 1}")
            assert store.table.ns_blocks == {
                service._space(service.sessions.get(session), f"m{10 * limit - 1}").ns: 1
            }

    asyncio.run(run())


def test_regression_an_admin_session_bound_in_many_tenants_rebuilt_its_binds_each_time():
    """Trimming the namespaces a session bound keeps those the store still binds, up to the
    limit per owner: an admin putting for many tenants (or a session in many shared
    namespaces) holds more than twice the limit while all are bound, and the trim rebuilt
    the whole dict at every new bind, each finding nothing to drop. A trim that drops
    little waits until the dict has doubled again."""
    limit = 4
    tenants = 25

    async def run() -> None:
        config = load_config(None, [f"server.max_namespaces_per_tenant={limit}"])
        store = BlockStore(config, tiers=[HostArena(8 * 4096, 4096)])
        service, _ = _service(store, config)
        session = Session("s", "admin", 0.0, tenant="ops", admin=True)
        rebuilds = 0
        try:
            for t in range(tenants):
                for i in range(limit):
                    space = Space(ns=1000 * t + i, owner=f"tenant{t}", name=f"m{i}")
                    before = session.bound
                    assert await service._bind(session, space) == store.owner_of(f"tenant{t}")
                    rebuilds += session.bound is not before
            # Every one is still bound, and each bind is remembered.
            assert len(session.bound) == tenants * limit
            assert rebuilds <= 6  # doubling: log2(100 / 8) + 1; each bind's rebuild: 92
        finally:
            await store.stop(flush=False)
            store.close()

    asyncio.run(run())


def test_leases_of_two_sessions_on_the_same_blocks_released_expired_and_closed_together():
    """Leases of two sessions pinning the same blocks, one released, three others expired in
    one pass of the reaper and the rest ending with their sessions, leave every pin, every hint
    budget charge and the tenant's lease bytes where the live leases say."""

    async def run() -> None:
        now = [100.0]
        async with _putting_session(["tenants=[{name: a, uids: [1000]}]"], 2) as opened:
            store, service, first, pool = opened
            service._clock = lambda: now[0]
            second = _open(service, service.tickets)
            keys = [bytes(range(32)), bytes(range(1, 33))]
            results, _ = await service.put(first, pool, keys, [0, 1], b"")
            assert (results == PutResult.STORED).all()
            await service.lookup(first, keys, True, 1000)
            released = (await service.lookup(first, keys, True, 60_000)).lease_id
            await service.lookup(first, keys[:1], True, 1000)
            await service.lookup(second, keys, True, 1000)
            await service.lookup(second, keys, True, 60_000)
            await service.lookup(second, keys[1:], True, 60_000)
            budget = store.hint_budget
            assert int(store.table.pins.sum()) == 2 + 2 + 1 + 2 + 2 + 1
            now[0] += 2.0
            service.release(first, released)
            assert service.expire_leases() == 3  # the reaper's pass
            assert int(store.table.pins.sum()) == 3
            assert store.check() == []
            t = time.monotonic()
            assert budget.charged_total(t) == int(store.table.nbytes[store.table.pins > 0].sum())
            assert int(budget.used.sum()) == budget.charged_total(t)
            service.close_session(first)
            service.close_session(second)
            assert int(store.table.pins.sum()) == 0
            assert budget.charged_total(time.monotonic()) == 0 == int(budget.used.sum())
            assert service.sessions.per_tenant_lease_bytes() == {}
            assert service.sessions.lease_count == 0
            assert store.check() == []

    asyncio.run(run())


async def _count_turns(turns: list[int], at_turn: Callable[[int], None]) -> None:
    """Count the event loop's turns in ``turns[0]``, calling ``at_turn`` with each count
    first: started just before a Check, turn 1 is the Check's first yield."""
    while True:
        at_turn(turns[0])
        turns[0] += 1
        await asyncio.sleep(0)


def _lose_key(table: BlockTable, row: int) -> np.uint64:
    """Flip a bit of the key that ``row`` holds so that the key no longer finds its block, and
    return the bit (xor it back to mend the key). A flipped key still finds its row where its
    probe chain (the hash is salted per process) passes the row's place in the index, which
    with one fixed bit happened about once in 1,500 runs: another bit is tried then."""
    for bit in range(64):
        flip = np.uint64(1 << bit)
        table.keys[row, 0] ^= flip
        if table.find_any(int(table.ns[row]), table.keys[row : row + 1])[0] != row:
            return flip
        table.keys[row, 0] ^= flip
    raise AssertionError(f"no bit flipped in its key hides row {row}")


def _open_admin(service: KVService, tickets: TicketBook) -> str:
    ticket = tickets.issue(TicketKind.SESSION, PeerCred(pid=1, uid=0, gid=0))
    return service.open_session("root", ticket, unix_socket=True).session_id


async def _put_blocks(
    service: KVService, session: str, pool: int, n: int = 128
) -> tuple[list[bytes], str]:
    """Put ``n`` blocks of new keys from ``session``'s pool: their keys, and an admin
    session to check them."""
    keys = [os.urandom(32) for _ in range(n)]
    results, _ = await service.put(session, pool, keys, range(n), b"")
    assert (results == PutResult.STORED).all()
    return keys, _open_admin(service, service.tickets)


async def _turns_of_a_check_of_128_blocks() -> int:
    """How many times the loop turns during a Check (that finds nothing) of 128 blocks."""
    async with _putting_session([], 128) as (_store, service, session, pool):
        _, admin = await _put_blocks(service, session, pool)
        turns = [0]
        counter = asyncio.ensure_future(_count_turns(turns, lambda _: None))
        await asyncio.sleep(0)
        before = turns[0]
        report = await service.check(admin)
        during = turns[0] - before
        counter.cancel()
        assert report.problems == [] and report.blocks == 128
        return during


def test_regression_a_check_held_the_event_loop_for_the_whole_store(monkeypatch):
    """A Check examined every block (its key looked up, its policies asked) in one step of
    the event loop: on a store of 262,144 blocks every other call waited 0.3-1.5 s for it.
    The blocks are now examined ``CHECK_SLICE_BLOCKS`` at a time, the loop turning between
    slices: here 128 blocks in slices of 16, so the loop turns at least 7 times."""
    monkeypatch.setattr(store_module, "CHECK_SLICE_BLOCKS", 16)

    during = asyncio.run(_turns_of_a_check_of_128_blocks())
    assert during >= 7, during


def test_a_check_examines_again_the_blocks_that_changed_between_its_slices(monkeypatch):
    """Blocks change between a Check's slices, and only what holds at its last step counts:
    blocks deleted before their slice came and a key broken only while its slice was
    examined are not reported, blocks put meanwhile do not count; a key broken throughout,
    and one broken after the first slice but before its own, are."""
    monkeypatch.setattr(store_module, "CHECK_SLICE_BLOCKS", 16)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            # Room for 8 more: no eviction.
            keys, admin = await _put_blocks(service, session, pool, 120)
            table = store.table
            live = table.live_ids()
            throughout, mended, later = (int(live[i]) for i in (3, 5, 100))
            flips = {row: _lose_key(table, row) for row in (throughout, mended)}
            changes: list[asyncio.Future[object]] = []

            def between_slices(turn: int) -> None:
                if turn != 1:
                    return
                # Slice 0 examined, slice 6 not.
                table.keys[mended, 0] ^= flips[mended]
                flips[later] = _lose_key(table, later)
                changes.append(asyncio.ensure_future(service.delete(session, keys[64:96])))
                new = [os.urandom(32) for _ in range(8)]
                changes.append(
                    asyncio.ensure_future(service.put(session, pool, new, range(8), b""))
                )

            counter = asyncio.ensure_future(_count_turns([0], between_slices))
            report = await service.check(admin, list_limit=10)
            counter.cancel()
            deleted, (put, _) = await asyncio.gather(*changes)
            assert deleted.deleted == 32 and (put == PutResult.STORED).all()
            assert len(report.problems) == 1, report.problems
            assert report.problems[0].startswith("2 blocks of namespace "), report.problems
            (detail,) = report.details
            assert detail.keys == [table.key_bytes(throughout), table.key_bytes(later)]
            for row in (throughout, later):
                table.keys[row, 0] ^= flips[row]
            assert (await service.check(admin)).problems == []

    asyncio.run(run())


def test_a_check_in_slices_finds_what_a_check_in_one_step_finds(monkeypatch):
    """Every invariant a Check examines block by block in slices (a key that finds its
    block, a copy its policy knows, in an allocated slot) or in its last step (a slot of one
    block, the allocator's and policy's counts) is still found: a store broken in each way
    gets the problems that ``check_problems`` finds in one step over the whole table."""
    monkeypatch.setattr(store_module, "CHECK_SLICE_BLOCKS", 16)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            _, admin = await _put_blocks(service, session, pool)
            table, (level,) = store.table, store.stack
            col, alloc = level.col, level.slots.allocator
            one, other, given_back, lost, stray = (
                int(b) for b in table.live_ids()[[3, 40, 41, 90, 120]]
            )
            other_slot, back_slot = int(table.slot[other, col]), int(table.slot[given_back, col])
            table.slot[other, col] = table.slot[one, col]
            alloc.free(back_slot)
            flip = _lose_key(table, lost)
            level.policy.remove(stray)
            report = await service.check(admin, list_limit=10)
            assert report.problems == [
                p.text for p in store.check_problems(pins=np.zeros(0, dtype=np.int64))
            ]
            for broken in (
                f"L1: slot {int(table.slot[one, col])} belongs to 2 blocks",
                "L1: 1 block holds a slot that is not allocated",
                "1 block of namespace ",
                "L1: 1 block with a copy unknown to the policy",
                "L1: the policy knows 127 blocks, 128 stored ones have a copy",
            ):
                assert any(p.startswith(broken) for p in report.problems), (broken, report)
            table.slot[other, col] = other_slot
            alloc.claim(back_slot, 4096)
            table.keys[lost, 0] ^= flip
            level.policy.insert(stray, 0.0)
            assert (await service.check(admin)).problems == []

    asyncio.run(run())


@pytest.mark.parametrize("busy_from", [1, 12])
def test_regression_a_settled_check_waited_before_its_slices_not_before_its_last_step(
    monkeypatch, busy_from
):
    """``settle_ms`` waits for the transfers in flight to end so that the last steps also
    examine what holds only then (a tier's allocated slots are exactly its blocks'). The
    wait came before the slices, and the calls let in between them started transfers again:
    a node that was quiet at the Check's start and busy at its slices' end got a check that
    was not strict, and a slot allocated to no block went unreported. The wait now comes
    after the slices, at each tier's step: here a block is in flight from the first slice's
    turn (1) or from a turn of the pins' slices, after the leases were read (12), until 200
    turns of the loop later, and the settled Check is strict and finds the slot."""
    monkeypatch.setattr(store_module, "CHECK_SLICE_BLOCKS", 16)
    monkeypatch.setattr(store_module, "CHECK_SLICE_ROWS", 16)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            keys = [os.urandom(32) for _ in range(120)]
            results, _ = await service.put(session, pool, keys, range(120), b"")
            assert (results == PutResult.STORED).all()
            admin = _open_admin(service, service.tickets)
            table, (level,) = store.table, store.stack
            leaked = level.slots.allocator.allocate(4096)
            assert leaked is not None
            busy = int(table.live_ids()[7])

            def in_flight(turn: int) -> None:
                if turn == busy_from:
                    table.inflight[busy] += 1
                elif turn == 200:
                    table.inflight[busy] -= 1

            assert store.quiescent()
            counter = asyncio.ensure_future(_count_turns([0], in_flight))
            report = await service.check(admin, settle_ms=60_000)
            counter.cancel()
            assert report.strict, report
            assert "L1: 121 slots allocated, 120 held by blocks" in report.problems, report
            level.slots.allocator.free(leaked)
            assert (await service.check(admin)).problems == []

    asyncio.run(run())


def test_regression_a_settled_check_held_its_copies_of_the_table_while_it_waited(monkeypatch):
    """A Check copies the columns each whole-table invariant reads and adds the copy up in
    the next turns; it kept every copy until its end (the pins' and namespaces', 22 bytes a
    row; each tier's, 15 more), through the waits for the transfers in flight before each
    tier's step (up to ``settle_ms``, 60 s at most), and Checks whose clients had left ran
    on to their end, each holding its own. Each copy now goes with the invariant it serves:
    here, on a table of 262,144 rows, a Check waiting for a block in flight holds less than
    a byte a row of new memory (9 KB; 5.8 MB before)."""
    rows = 1 << 18

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            _, admin = await _put_blocks(service, session, pool, 64)
            # What a process's first Check imports (numpy.ma) is not the Check's.
            assert (await service.check(admin)).problems == []
            table = store.table
            table._grow(rows)
            table._next_row = rows  # rows freed long ago: they hold nothing
            busy = int(table.live_ids()[7])
            held: list[int] = []
            quiescent = store.quiescent

            def waited() -> bool:
                held.append(tracemalloc.get_traced_memory()[0] - before)
                return quiescent()

            def in_flight(turn: int) -> None:
                if turn == 0:
                    table.inflight[busy] += 1
                elif turn == 1000:
                    table.inflight[busy] -= 1

            monkeypatch.setattr(store, "quiescent", waited)
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                counter = asyncio.ensure_future(_count_turns([0], in_flight))
                report = await service.check(admin, settle_ms=60_000)
                counter.cancel()
            finally:
                tracemalloc.stop()
            assert report.strict and report.problems == [], report
            assert len(held) > 2 and max(held) < rows, held

    asyncio.run(run())


def test_regression_a_check_listed_the_key_of_the_block_that_took_a_broken_block_s_row():
    """A Check lists each broken invariant's blocks by key (``list_limit``). It found them at
    the step that read their rows (here a pin count that differs from the leases', at the
    step that read the leases) and read their keys after its last step, past the wait for
    the transfers in flight: a block deleted meanwhile, its row taken by a new key, was
    listed under that new key, a block nothing was wrong with. Only the blocks still there
    are listed now (the total still counts them all)."""

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            keys, admin = await _put_blocks(service, session, pool, 8)
            await service.lookup(session, keys[:1], True, 60_000)
            table = store.table
            broken, busy = (int(table.lookup(0, keys_to_words(keys[i : i + 1]))[0]) for i in (0, 1))
            table.pins[broken] -= 1  # the lease still holds it
            table.inflight[busy] += 1
            new = os.urandom(32)
            quiescent, changes = store.quiescent, []

            async def change() -> None:
                assert (await service.delete(session, keys[:1])).deleted == 1
                results, _ = await service.put(session, pool, [new], [9], b"")
                assert (results == PutResult.STORED).all()
                table.inflight[busy] -= 1

            def waited() -> bool:
                if not changes:  # the settle before L1's step, after the leases were read
                    changes.append(asyncio.ensure_future(change()))
                return quiescent()

            store.quiescent = waited  # type: ignore[method-assign]
            report = await service.check(admin, settle_ms=60_000, list_limit=10)
            await changes[0]
            assert table.key_bytes(broken) == new  # the row the broken block held
            i = report.problems.index("1 block's pin count differs from its live leases")
            (detail,) = (d for d in report.details if d.problem == i)
            assert detail.keys == [] and detail.keys_total == 1, (detail.keys == [new], detail)
            # The lease takes the new block, which makes the pins whole again.
            (lease,) = service.sessions.leases()
            lease.refs[0] = table.ref(broken)
            table.pins[broken] += 1
            assert (await service.check(admin)).problems == []

    asyncio.run(run())


def test_a_check_reads_the_table_arrays_anew_after_they_grow_between_its_slices(monkeypatch):
    """The table's arrays are replaced by larger ones when it grows, which a put may do
    between a Check's slices: a slice that read an array kept from before would examine the
    old one, and the last step examines again only what the slices found. Here the table
    grows after the first slice and then, in the new arrays only, a later slice's block
    is given a slot its allocator has not handed out: the Check reports it."""
    monkeypatch.setattr(store_module, "CHECK_SLICE_BLOCKS", 16)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            results, _ = await service.put(
                session, pool, [os.urandom(32) for _ in range(64)], range(64), b""
            )
            assert (results == PutResult.STORED).all()
            admin = _open_admin(service, service.tickets)
            table, (level,) = store.table, store.stack
            alloc, col = level.slots.allocator, level.col
            later = int(table.live_ids()[50])
            held = int(table.slot[later, col])
            unallocated = alloc.allocate(4096)
            assert unallocated is not None
            alloc.free(unallocated)
            old_slots, capacity = table.slot, table.capacity

            def between_slices(turn: int) -> None:
                if turn == 1:
                    table._grow(capacity * 2)
                    table.slot[later, col] = unallocated

            counter = asyncio.ensure_future(_count_turns([0], between_slices))
            report = await service.check(admin, list_limit=10)
            counter.cancel()
            assert table.slot is not old_slots and table.capacity == capacity * 2
            # (The slot lies in a segment no size class holds: the tenant's slot sum differs too.)
            assert report.problems[0] == "L1: 1 block holds a slot that is not allocated", report
            assert report.details[0].slots == [unallocated]
            table.slot[later, col] = held
            assert (await service.check(admin)).problems == []

    asyncio.run(run())


def test_regression_a_check_compared_the_whole_table_with_its_counts_in_one_step(monkeypatch):
    """After its slices, a Check compared the whole table with the counts kept beside it
    (blocks per namespace, bytes and slots per tenant, pins, a sort of each tier's slots) in
    one step of the event loop: 42-99 ms at 1,048,576 blocks, every other call waiting. It
    copies the columns in one step now and adds them up ``CHECK_SLICE_ROWS`` rows a turn:
    here the suspects' slices take one turn (all 128 blocks in one), the copy's 8 more."""
    monkeypatch.setattr(store_module, "CHECK_SLICE_BLOCKS", 1 << 20)
    monkeypatch.setattr(store_module, "CHECK_SLICE_ROWS", 16, raising=False)

    during = asyncio.run(_turns_of_a_check_of_128_blocks())
    assert during >= 8, during


def test_a_check_adds_up_the_copy_of_the_table_it_made_at_one_moment(monkeypatch):
    """The whole-table invariants are added up over a copy made in one step: blocks put,
    deleted and pinned while the copy's slices run do not make the Check report a problem,
    and counts broken before it are reported (per namespace, per tenant, a freed row holding
    a copy, a pin count)."""
    monkeypatch.setattr(store_module, "CHECK_SLICE_BLOCKS", 16)
    monkeypatch.setattr(store_module, "CHECK_SLICE_ROWS", 16)

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            # Room for 8 more: no eviction.
            keys, admin = await _put_blocks(service, session, pool, 120)
            changes: list[asyncio.Future[object]] = []

            parts = {9: keys[32:64], 20: keys[64:96], 31: keys[96:120]}

            def while_adding_up(turn: int) -> None:
                # The suspects' 8 slices end at turn 7; the copies' steps and slices (pins,
                # namespaces, L1) come after, about 8 turns each.
                if turn in parts:
                    changes.append(asyncio.ensure_future(service.delete(session, parts[turn])))
                    new = [os.urandom(32) for _ in range(4)]
                    changes.append(
                        asyncio.ensure_future(service.put(session, pool, new, range(4), b""))
                    )
                    changes.append(
                        asyncio.ensure_future(service.lookup(session, keys[:8], True, 60_000))
                    )

            counter = asyncio.ensure_future(_count_turns([0], while_adding_up))
            report = await service.check(admin)
            counter.cancel()
            await asyncio.gather(*changes)
            assert len(changes) == 9 and report.problems == [], report.problems
            assert store.table.live_ids().size == 120 - 88 + 12
            # Broken counts are still found, in turns.
            table, (level,) = store.table, store.stack
            col = level.col
            live = table.live_ids()
            ns = int(table.ns[live[0]])
            table.ns_blocks[ns] += 1
            owner = int(table.owner[live[0]])
            table.usage[col, owner] += 1
            freed = int(np.flatnonzero(table.state[: table.rows] == 0)[0])
            table.slot[freed, col] = table.slot[live[1], col]
            table.pins[live[2]] += 1
            report = await service.check(admin)
            for broken in (
                "the blocks counted per namespace differ from the live blocks'",
                "L1: 1 freed row still holds a copy",
                f"L1: slot {int(table.slot[live[1], col])} belongs to 2 blocks",
                "L1: per-tenant usage does not add up to its blocks",
                "L1: per-tenant slots do not add up to its blocks",
                "1 block's pin count differs from its live leases",
            ):
                assert any(p.startswith(broken) for p in report.problems), (broken, report)
            assert report.problems == [
                p.text for p in store.check_problems(pins=_pinned_rows(service))
            ]
            table.ns_blocks[ns] -= 1
            table.usage[col, owner] -= 1
            table.slot[freed, col] = -1
            table.pins[live[2]] -= 1
            assert (await service.check(admin)).problems == []

    asyncio.run(run())


def _pinned_rows(service: KVService) -> np.ndarray:
    """The row of each pin the service's live leases hold."""
    refs = [lease.refs for lease in service.sessions.leases()]
    return service.store.table.resolve_many(np.concatenate([np.zeros(0, np.int64), *refs]))


def test_regression_a_check_resolved_the_leases_blocks_one_by_one_in_its_last_step(monkeypatch):
    """The Check's last step (one step of the loop) resolved every block of every live lease
    with a Python call each: 37-79 ms of the loop for 16 leases of 4,096 blocks. They are
    resolved at once now, and what they tell is unchanged: a lease naming a block that was
    freed, and a pin count that differs from the leases', are reported."""

    async def run() -> None:
        async with _putting_session([], 128) as (store, service, session, pool):
            keys = [os.urandom(32) for _ in range(128)]
            results, _ = await service.put(session, pool, keys, range(128), b"")
            assert (results == PutResult.STORED).all()
            await service.lookup(session, keys, True, 60_000)
            (lease,) = service.sessions.leases()
            admin = _open_admin(service, service.tickets)
            table = store.table
            resolved: list[int] = []
            resolve = table.resolve
            monkeypatch.setattr(table, "resolve", lambda ref: resolved.append(ref) or resolve(ref))
            assert (await service.check(admin)).problems == []
            stale = int(lease.refs[5])
            lease.refs[5] = stale + (1 << 32)  # a later generation of the row: freed
            report = await service.check(admin)
            assert report.problems == [
                f"lease {lease.lease_id} pins a block that was freed",
                "1 block's pin count differs from its live leases",
            ], report.problems
            assert resolved == []
            lease.refs[5] = stale
            assert (await service.check(admin)).problems == []

    asyncio.run(run())


def test_regression_a_session_given_up_held_its_leases_and_slot_until_its_process_exited():
    """A blocking client that gives up a channel an interrupt left locked cannot end that
    session's stream: the daemon kept the session, its leases and one of the tenant's
    server.max_sessions_per_tenant until the process exited. The client's next OpenSession
    names it (given_up_sessions) and the daemon ends it before counting the new one, but
    only one the same process (pid and uid) opened in the same tenant: a session id named by
    another process, by another tenant's session or over TCP ends nothing, and an id that is
    not open is ignored."""

    async def run() -> None:
        store = SlowStore()
        store.release.set()
        service, tickets = _service(store)
        service.sessions.max_per_tenant = 2
        token = b"other-tenant-secret-0123456789"
        ours = Tenant("ours", uids=frozenset({PEER.uid, PEER.uid + 1}))
        service.tenants = TenantDirectory([ours, Tenant("other", token_digest=_digest(token))])

        def open_as(peer: PeerCred | None, given_up: list[str], tok: bytes = b"") -> Session:
            ticket = tickets.issue(TicketKind.SESSION, peer) if peer else b""
            return service.open_session(
                "t", ticket, unix_socket=peer is not None, token=tok, given_up=given_up
            )

        given_up = open_as(PEER, []).session_id
        lease = await service.lookup(given_up, [bytes(32)] * 3, True, 0)
        assert lease.lease_id and store.pins == 3
        remote = open_as(None, [], token).session_id  # over TCP
        hostile = [given_up, remote, "0" * 32, "not an id"]
        # Another process of the same uid and tenant, another uid of the tenant with the same
        # pid, the same process bound to another tenant, a TCP session of remote's tenant:
        # none ends a session.
        for peer, tok in [
            (replace(PEER, pid=PEER.pid + 1), b""),
            (replace(PEER, uid=PEER.uid + 1), b""),
            (PEER, token),
            (None, token),
        ]:
            service.close_session(open_as(peer, hostile, tok).session_id)
        assert service.sessions.find(given_up) is not None
        assert service.sessions.find(remote) is not None
        assert store.pins == 3 and service.sessions.lease_count == 1
        second = open_as(PEER, []).session_id  # the tenant's two sessions are open
        with pytest.raises(ResourceExhausted, match=r"server\.max_sessions_per_tenant"):
            open_as(PEER, ["0" * 32])
        # The same process names the session it gave up: it ends, and its slot is free.
        new = open_as(PEER, [given_up, "0" * 32, "not an id"]).session_id
        assert service.sessions.find(given_up) is None
        assert store.pins == 0 and service.sessions.lease_count == 0
        assert service.sessions.tenant_sessions("ours") == 2
        for session in (second, new, remote):
            service.close_session(session)

    asyncio.run(run())


def test_regression_an_open_session_a_drain_refused_ended_none_of_the_sessions_it_named():
    """``kvtier drain --wait`` waits for the open sessions to end. A session a client gave up
    with a locked channel ends only when that client's next OpenSession names it, and a
    draining daemon refused that OpenSession before reading the names: the drain waited
    for it until the client's process exited. The names are now read before the refusal."""
    service, tickets = _service(SlowStore())
    given_up = _open(service, tickets)
    service.draining = True
    ticket = tickets.issue(TicketKind.SESSION, PEER)
    with pytest.raises(Draining):
        service.open_session("t", ticket, unix_socket=True, given_up=[given_up])
    assert service.sessions.find(given_up) is None
    assert service.sessions.session_count == 0
