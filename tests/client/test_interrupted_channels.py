"""A KeyboardInterrupt inside gRPC's own code no longer breaks the blocking client for good.

gRPC's sync channel is not safe against an exception a signal handler raises: one that lands
while it starts a call (at the release of the channel's lock, a ``threading.Condition``
entered from its Cython code) leaves that lock held, and every later call on the channel,
the session's and a Release's included, waited for ever, past its deadline. The client now
gives up a channel that such an exception left, opening a new one and a new session (its
pools registered again, as after a daemon restart); the old channel and session are ended on
a thread of their own.
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import grpc
import pytest
from harness import tenant_token

from kvtier.client import Client, LoadSegment, Namespace, PoolLayout, SharedMemoryPool
from kvtier.client import sync as sync_module
from kvtier.client.errors import (
    DeadlineExceededError,
    NotFoundError,
    UnavailableError,
    unclean,
)
from kvtier.client.sync import RegisteredPool

NS = Namespace(model="interrupted-channels", kv_dtype="uint8", block_tokens=4)
LAYOUT = PoolLayout.staging(num_layers=2, num_pages=4, block_tokens=4, chunk_bytes=64)
TOKENS = list(range(8))
LEASE_MS = 600_000  # far longer than the test: only a Release or the session's end ends it
GRPC_CHANNEL = os.path.join("grpc", "_channel.py")
GRPC_COMMON = os.path.join("grpc", "_common.py")


def in_grpc_lock_exit(frame: FrameType, where: str) -> bool:
    """Whether ``frame`` is a ``threading.Condition``'s ``__exit__`` that gRPC's channel code
    ``where`` called (maybe through its Cython part, which has no frame of its own)."""
    caller = frame.f_back
    return (
        frame.f_code.co_name == "__exit__"
        and frame.f_code.co_filename == threading.__file__
        and caller is not None
        and caller.f_code.co_filename.endswith(GRPC_CHANNEL)
        and caller.f_code.co_name == where
    )


def ends_in_time(call: Callable[[], Any], bound_s: float = 30.0) -> Any:
    """``call()``'s result, on a thread: an assertion error, not a hung test, when it does not
    end within ``bound_s`` (the client's timeout is far shorter)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(bound_s)
    assert result, f"the call did not end within {bound_s}s"
    return result[0]


@contextlib.contextmanager
def stored(daemon: Any, timeout_s: float) -> Iterator[tuple[Client, RegisteredPool, int]]:
    """A client of ``daemon``, a pool holding TOKENS' two blocks (pages 0 and 1), and the
    daemon's pid (for SIGSTOP)."""
    assert daemon.proc is not None
    client = Client(daemon.address, timeout_s=timeout_s)
    with client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        yield client, pool, daemon.proc.pid


def pinning_lookup(client: Client, pool: RegisteredPool) -> None:
    client.lookup(pool.binding.keys(TOKENS), pin=True, lease_ms=LEASE_MS)


def job(client: Client, pool: RegisteredPool) -> None:
    client.submit_load(pool, [LoadSegment(pool.binding.keys(TOKENS), [2, 3])])


def live_ids(client: Client, pool: RegisteredPool) -> None:
    client.live_ids(pool.binding)


def interrupt_in_grpcs_lock(where: str, interrupted: Callable[..., None], *args: Any) -> None:
    """``interrupted(*args)``, interrupted at the entry of a lock's ``__exit__`` in gRPC's
    code ``where`` (a trace function raises the KeyboardInterrupt there, where a signal's
    handler would), so that the lock stays held, as the tester's SIGINT storm left it: the
    client gives the channel up, and nothing can end that channel or its session's
    stream."""
    landed: list[str] = []

    def interrupt(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and in_grpc_lock_exit(frame, where):
            sys.settrace(None)
            landed.append(where)
            raise KeyboardInterrupt

    interrupted_under(interrupt, interrupted, *args)
    assert landed


def interrupt_as_first_event_taken(interrupted: Callable[[], None]) -> None:
    """``interrupted()``, interrupted where its OpenSession's ``next()`` leaves the call's own
    lock with the session's first event taken, so that the daemon has opened the session (it
    opens it before it sends that event) and the lock stays held. Not at the first lock exit
    that ``_next`` reaches: that is the channel's, in gRPC's Cython ``operate``, as the
    receive is queued, before the daemon may have run the OpenSession at all."""
    landed: list[str] = []

    def interrupt(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and in_grpc_lock_exit(frame, "_next"):
            caller = frame.f_back
            assert caller is not None
            if (
                frame.f_locals["self"] is caller.f_locals["self"]._state.condition
                and caller.f_locals.get("response") is not None
            ):
                sys.settrace(None)
                landed.append("_next")
                raise KeyboardInterrupt

    interrupted_under(interrupt, interrupted)
    assert landed


def interrupted_under(trace: Callable[..., Any], call: Callable[..., Any], *args: Any) -> None:
    """``call(*args)`` traced by ``trace``, which ends it with a KeyboardInterrupt."""
    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            call(*args)
    finally:
        sys.settrace(None)


def unregister_nowait(client: Client, pool: RegisteredPool) -> None:
    client.unregister_pool_nowait(pool.binding)


# "create": the start of a call (the pinning Lookup's, which is sent; a job's first Get);
# "is_active": the client's check of its session's stream, before the call, at a job's start
# (outside any call: Client.session_id's own guard), or when the connectors ask for the
# pool's live ids; "add_done_callback": a sent call's callback (a job's part's, an
# unregistration's whose answer nobody waits for), the call's own lock, which gRPC's thread
# that delivers every answer of the channel takes to deliver its answer.
@pytest.mark.parametrize(
    "where, interrupted",
    [
        ("create", pinning_lookup),
        ("is_active", pinning_lookup),
        ("create", job),
        ("is_active", job),
        ("is_active", live_ids),
        ("add_done_callback", job),
        ("add_done_callback", unregister_nowait),
    ],
    ids=[
        "lookup-start",
        "lookup-session-check",
        "job-start",
        "job-session-check",
        "live-ids-session-check",
        "job-callback",
        "unregister-nowait-callback",
    ],
)
def test_regression_an_interrupt_in_grpcs_locks_leaves_the_client_working(
    daemon, where, interrupted
):
    """The interrupt leaves gRPC's lock held (``interrupt_in_grpcs_lock``). Before, the next
    call never ended."""
    with Client(daemon.address, timeout_s=3) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        keys = pool.binding.keys(TOKENS)
        interrupt_in_grpcs_lock(where, interrupted, client, pool)
        assert ends_in_time(lambda: client.lookup(keys).prefix_len) == 2
        assert ends_in_time(lambda: pool.load(TOKENS, [2, 3])) == 8
        assert ends_in_time(lambda: client.health())


def test_an_interrupt_in_a_releases_session_check_leaves_the_client_working(daemon):
    """A Release checks the open session's stream (``_open_session_id``) outside any call
    and any guard of its own: an interrupt there, at the stream's lock exit, gives the
    channel up as at a call's start (``Client._invoke``'s guard), and the client's next calls
    end."""
    with stored(daemon, timeout_s=3) as (client, pool, _):
        keys = pool.binding.keys(TOKENS)
        lease = client.lookup(keys, pin=True, lease_ms=LEASE_MS)
        interrupt_in_grpcs_lock("is_active", client.release, lease.lease_id)
        assert ends_in_time(lambda: client.lookup(keys).prefix_len) == 2
        assert ends_in_time(lambda: pool.load(TOKENS, [2, 3])) == 8


def test_an_interrupt_in_the_release_of_an_unclaimed_lease_leaves_the_client_working(
    daemon, monkeypatch
):
    """An interrupt once a pinning Lookup's call has ended, as ``lookup`` makes its result,
    has the client release that lease without waiting (``flows.release_unclaimed``); a
    second one in that Release's ``add_done_callback``, at its lock exit, gives the channel
    up as at a call's start (``Client._release_nowait``'s guard): the client's next calls
    end, and the lease goes with the given-up session."""
    with stored(daemon, timeout_s=3) as (client, pool, _):
        keys = pool.binding.keys(TOKENS)

        def interrupted_result(answer: Any) -> Any:
            raise KeyboardInterrupt

        monkeypatch.setattr(sync_module.t, "lookup_result", interrupted_result)
        interrupt_in_grpcs_lock(
            "add_done_callback", lambda: client.lookup(keys, pin=True, lease_ms=LEASE_MS)
        )
        monkeypatch.undo()
        assert ends_in_time(lambda: client.lookup(keys).prefix_len) == 2
        assert ends_in_time(lambda: pool.load(TOKENS, [2, 3])) == 8
        deadline = time.monotonic() + 30  # a bound on the wait, not a timing
        while (leases := client.stats().gauges["leases"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert leases == 0


def test_regression_an_interrupt_in_a_jobs_cancel_leaves_the_client_working(daemon):
    """``TransferJob.cancel`` cancels its calls through gRPC's locks too (a KeyboardInterrupt
    handler's own cancel, hit by a second Ctrl-C): an interrupt landing there, at the
    channel's lock exit, gives the channel up as at a call's start. Before, the client kept
    the channel, whose lock stayed held, and its next call never ended."""
    with stored(daemon, timeout_s=3) as (client, pool, pid):
        keys = pool.binding.keys(TOKENS)
        landed: list[str] = []

        def interrupt(frame: FrameType, event: str, arg: Any) -> None:
            if event == "call" and in_grpc_lock_exit(frame, "cancel"):
                sys.settrace(None)
                landed.append("cancel")
                raise KeyboardInterrupt

        os.kill(pid, signal.SIGSTOP)  # the job's Get stays in flight until it is cancelled
        try:
            load = client.submit_load(pool, [LoadSegment(keys, [2, 3])])
            sys.settrace(interrupt)
            try:
                with pytest.raises(KeyboardInterrupt):
                    load.cancel()
            finally:
                sys.settrace(None)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert landed
        assert ends_in_time(lambda: client.lookup(keys).prefix_len) == 2
        assert ends_in_time(lambda: pool.load(TOKENS, [2, 3])) == 8


def test_regression_an_interrupt_in_close_left_the_session_open(daemon):
    """A KeyboardInterrupt in ``close()`` as it starts to cancel the session's stream: the
    session and the channel are still ended, on a thread of the client's own (one that
    parks where the interrupt left gRPC's lock held). Before, close() had no guard, and the
    session stayed open in the daemon (its leases, pools and slot of
    server.max_sessions_per_tenant) until the process exited: its finalizer was already
    detached."""
    client = Client(daemon.address, timeout_s=3)
    session = client.session_id
    landed: list[str] = []

    def interrupt(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and in_grpc_call_on(frame, (GRPC_CHANNEL, "cancel")):
            sys.settrace(None)
            landed.append("cancel")
            raise KeyboardInterrupt

    interrupted_under(interrupt, client.close)
    assert landed
    with daemon.client(timeout_s=3) as observer:
        deadline = time.monotonic() + 30  # a bound on the wait, not a timing
        while (sessions := observer.stats().gauges["sessions"]) > 1:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert sessions == 1, f"session {session} still open"


def test_regression_a_pinning_lookup_on_a_channel_an_interrupt_left_locked_waited_for_ever(
    daemon,
):
    """A pinning Lookup another thread has in flight when an interrupt leaves the channel's
    lock held ends by the client's own bound past its deadline (DeadlineExceededError).
    Before, it waited for ever: gRPC delivers its answer and its deadline under that lock."""
    with stored(daemon, timeout_s=1) as (client, pool, pid):
        keys = pool.binding.keys(TOKENS)
        waiting = threading.Event()
        outcome: list[BaseException] = []

        def in_flight() -> None:
            def mark(frame: FrameType, event: str, arg: Any) -> Any:
                if event == "call" and in_grpc_call_on(frame, (GRPC_CHANNEL, "result")):
                    sys.settrace(None)
                    waiting.set()
                return None

            sys.settrace(mark)
            try:
                client.lookup(keys, pin=True, lease_ms=LEASE_MS)
            except BaseException as e:
                outcome.append(e)
            finally:
                sys.settrace(None)

        os.kill(pid, signal.SIGSTOP)  # the other thread's Lookup stays unanswered
        try:
            thread = threading.Thread(target=in_flight, daemon=True)
            thread.start()
            assert waiting.wait(30)
            interrupt_in_grpcs_lock("create", pinning_lookup, client, pool)
        finally:
            os.kill(pid, signal.SIGCONT)
        thread.join(30)
        assert not thread.is_alive(), "the pinning Lookup still waits"
        assert isinstance(outcome[0], DeadlineExceededError), outcome
        assert ends_in_time(lambda: pool.load(TOKENS, [2, 3])) == 8


def test_regression_what_an_interrupt_left_unlocked_was_kept_for_good(daemon):
    """The client keeps what an interrupt may have left locked (the given-up channel, the
    interrupted call) only until a thread of its own has ended it: an interrupt that left no
    lock held keeps nothing once that thread ends. Before, each interrupt's channel,
    session call and interrupted call were kept for the life of the process (some 12 kB
    an interrupt, 84 objects: a loop of interrupts grew the process without bound)."""
    with Client(daemon.address, timeout_s=3) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        channel = weakref.ref(client._channel)
        calls: list[weakref.ref[Any]] = []

        def interrupt(frame: FrameType, event: str, arg: Any) -> None:
            # At the wait for the Lookup's answer, before it takes any lock.
            if event == "call" and in_grpc_call_on(frame, (GRPC_CHANNEL, "result")):
                sys.settrace(None)
                calls.append(weakref.ref(frame.f_locals["self"]))
                raise KeyboardInterrupt

        interrupted_under(interrupt, pinning_lookup, client, pool)
        assert calls
        assert ends_in_time(lambda: client.lookup(pool.binding.keys(TOKENS)).prefix_len) == 2
        assert collected_in_time([channel, calls[0]])


def test_regression_a_client_whose_pinning_lookup_an_interrupt_left_locked_was_kept(daemon):
    """A Ctrl-C in the wait for a pinning Lookup's answer, and a second one as that wait
    leaves the call's lock, leave that lock held: the call's cancel parks, and the client
    keeps the call for good (``Client.interrupted``). The client hung a callback on it, to
    release the answer's lease, which held the client: dropped unclosed, it was never
    collected, and its new channel and session stayed open until the process exited. The
    given-up session's end frees that lease; the callback is gone."""
    dropped = weakref.ref(interrupted_twice_in_a_pinning_lookup(daemon))
    assert collected_in_time([dropped])


def interrupted_twice_in_a_pinning_lookup(daemon: Any) -> Client:
    """A client (made here, not closed) whose pinning Lookup was interrupted in its wait
    (SIGINT, as a Ctrl-C) and again as the wait leaves the call's lock, after which a call
    on its new channel ran."""
    assert daemon.proc is not None
    client = Client(daemon.address, timeout_s=3)
    with SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        waiting = threading.Event()
        landed: list[str] = []

        def interrupt(frame: FrameType, event: str, arg: Any) -> None:
            if event == "call" and in_grpc_call_on(frame, (GRPC_COMMON, "_wait_once")):
                waiting.set()
            elif event == "call" and in_grpc_lock_exit(frame, "result"):
                sys.settrace(None)
                landed.append("lock exit")
                raise KeyboardInterrupt

        def ctrl_c() -> None:
            if waiting.wait(30):
                _thread.interrupt_main()

        # Python's own SIGINT handler, which interrupt_main needs (xdist's workers ignore it).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # no answer while the Lookup waits
        interrupter = threading.Thread(target=ctrl_c)
        interrupter.start()
        try:
            interrupted_under(interrupt, pinning_lookup, client, pool)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
            interrupter.join()
            signal.signal(signal.SIGINT, previous)
        assert landed == ["lock exit"]
        assert ends_in_time(lambda: client.lookup(pool.binding.keys(TOKENS)).prefix_len) == 2
    return client


def collected_in_time(refs: list[weakref.ref[Any]], bound_s: float = 30.0) -> bool:
    """Whether the objects of ``refs`` are collected within ``bound_s`` (the threads that
    end them end at once)."""
    deadline = time.monotonic() + bound_s
    while any(ref() is not None for ref in refs) and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    return all(ref() is None for ref in refs)


def in_grpc_call_on(frame: FrameType, names: tuple[str, str]) -> bool:
    """Whether ``frame`` is the call of the function ``names[1]`` of the file ``names[0]``."""
    return frame.f_code.co_filename.endswith(names[0]) and frame.f_code.co_name == names[1]


# The other thread's call: "started" on the given-up channel, its answer awaited (ended by
# the channel's close: CANCELLED); "unstarted", its stub taken from that channel before the
# swap and the call made after the close.
@pytest.mark.parametrize(
    "where",
    [(GRPC_CHANNEL, "result"), (os.path.join("client", "sync.py"), "_until_run")],
    ids=["started", "unstarted"],
)
def test_regression_a_call_on_a_channel_another_thread_gave_up_is_sent_again(daemon, where):
    """A client shared by threads: while one thread's call is on the channel, another's
    interrupt gives that channel up (``Client.interrupted``), and the channel is closed. The
    first thread's call is sent again on the new channel, in the new session, as one whose
    session the daemon ended. Before, both failed with an UnavailableError saying the daemon
    was stopping (the close's CANCELLED, "Channel closed!")."""
    with Client(daemon.address, timeout_s=3) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        keys = pool.binding.keys(TOKENS)
        old_session = client.session_id
        landed: list[str] = []

        def give_up(frame: FrameType, event: str, arg: Any) -> Any:
            if event != "call" or not in_grpc_call_on(frame, where):
                return None
            sys.settrace(None)
            landed.append(where[1])
            give_up_and_close(client)
            return None

        sys.settrace(give_up)
        try:
            lease = client.lookup(keys, pin=True, lease_ms=LEASE_MS)
        finally:
            sys.settrace(None)
        assert landed
        assert lease.prefix_len == 2
        assert client.session_id != old_session
        client.release(lease.lease_id)
        assert ends_in_time(lambda: pool.load(TOKENS, [2, 3])) == 8


class ChannelClosed(grpc.RpcError):
    """The CANCELLED that closing a channel gives the calls still on it ("Channel closed!")."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "Channel closed!"


def cut_off_after_its_run(client: Client, method: str) -> Callable[..., Any]:
    """A trace that, once the daemon has answered the caller's call ``method``, gives the
    channel up and closes it as another thread's interrupt does, and ends the call with the
    close's CANCELLED: the answer the close beat (gRPC reads it in
    ``_end_unary_response_blocking``, which the trace enters first)."""

    def cut_off(frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or not in_grpc_call_on(
            frame, (GRPC_CHANNEL, "_end_unary_response_blocking")
        ):
            return None
        if not frame.f_locals["state"].method.endswith("/" + method):
            return None
        sys.settrace(None)
        give_up_and_close(client)
        raise ChannelClosed()

    return cut_off


@pytest.mark.parametrize("method", ["Delete", "Put"])
def test_regression_a_call_the_daemon_ran_was_sent_again_after_another_thread_gave_up(
    daemon, method
):
    """A Delete or a Put on a channel that another thread's interrupt gave up, whose close
    ended it (CANCELLED) once the daemon had run it, is not sent again in the new session:
    it fails with an UnavailableError saying the daemon may have run it. Before, it was
    sent again, and its answer was that of a second run: the deleted keys reported missing
    (``deleted`` 0), the stored blocks present, as if another writer had stored them."""
    with Client(daemon.address, timeout_s=3) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        if method == "Delete":
            assert pool.store(TOKENS, [0, 1]) == 8
        keys = pool.binding.keys(TOKENS)
        old_session = client.session_id
        sys.settrace(cut_off_after_its_run(client, method))
        try:
            with pytest.raises(UnavailableError, match="may have run it") as raised:
                if method == "Delete":
                    client.delete(keys)
                else:
                    pool.store(TOKENS, [0, 1])
        finally:
            sys.settrace(None)
        assert old_session in str(raised.value)
        assert unclean(raised.value)
        # The daemon ran it once: the keys gone, or stored.
        present = ends_in_time(lambda: client.lookup(keys).prefix_len)
        assert present == (0 if method == "Delete" else 2)
        assert client.session_id != old_session


def test_regression_a_loads_release_cut_off_after_its_run_failed_the_load(daemon):
    """A load whose Release another thread's interrupt cut off (its channel given up and
    closed once the daemon had run it) returns what it loaded: the lease went with the
    given-up session, and the Release fails as one whose session ended (NotFound, which the
    load's cleanup reads as a lease already gone). Before, it failed with the
    UnavailableError of a call the daemon may have run, after every block had loaded."""
    with Client(daemon.address, timeout_s=3) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        old_session = client.session_id
        sys.settrace(cut_off_after_its_run(client, "Release"))
        try:
            loaded = pool.load(TOKENS, [2, 3])
        finally:
            sys.settrace(None)
        assert loaded == 8
        assert client.session_id != old_session
        assert ends_in_time(lambda: pool.load(TOKENS, [2, 3])) == 8


def test_regression_a_memfd_registration_cut_off_after_its_run_was_sent_with_its_spent_ticket(
    daemon,
):
    """A memfd pool's RegisterPool that another thread's interrupt cut off once the daemon had
    run it is made again in the new session with a new ticket of the descriptor. Before, it
    was sent again with the first ticket, which that run had spent: UnauthenticatedError ('the
    credential ticket is unknown, already used or expired')."""
    with Client(daemon.address, timeout_s=3) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        assert shm.backing == "memfd"
        old_session = client.session_id
        sys.settrace(cut_off_after_its_run(client, "RegisterPool"))
        try:
            pool = client.register_pool(shm, LAYOUT, NS)
        finally:
            sys.settrace(None)
        assert client.session_id != old_session
        assert pool.binding.session_id == client.session_id
        assert pool.store(TOKENS, [0, 1]) == 8
        assert ends_in_time(lambda: pool.load(TOKENS, [2, 3])) == 8


def test_regression_a_session_being_opened_on_a_channel_another_thread_gave_up(daemon):
    """A client shared by threads: while one thread waits for its new session's first
    answer, another's interrupt gives the channel up, and its close ends that OpenSession.
    The session is opened again on the new channel. Before, the call that needed it failed
    at once with DeadlineExceededError ('the daemon did not open a session within 3s'), as
    if the client's timeout had passed."""
    with Client(daemon.address, timeout_s=3) as client:
        landed: list[str] = []

        def give_up(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "call" and in_grpc_call_on(frame, (GRPC_CHANNEL, "_next")):
                sys.settrace(None)
                landed.append("_next")
                give_up_and_close(client)
            return None

        sys.settrace(give_up)
        try:
            gauges = client.stats().gauges
        finally:
            sys.settrace(None)
        assert landed
        assert gauges["sessions"] >= 1
        assert ends_in_time(lambda: client.lookup([bytes(32)]).prefix_len) == 0


def give_up_and_close(client: Client) -> None:
    """Give the client's channel up as another thread's interrupt does, and close it here,
    as the given-up channel's closing thread does (closing it twice is harmless), so that
    the call goes on only once the channel is closed."""
    channel = client._channel
    client.interrupted(KeyboardInterrupt())
    channel.close()


# "started": the job's Get sent, its answer awaited when the channel is given up and closed;
# "unstarted": its stub taken from the channel before the swap, the Get made after the close.
@pytest.mark.parametrize("event", ["return", "call"], ids=["started", "unstarted"])
def test_regression_a_jobs_part_on_a_channel_another_thread_gave_up_says_so(daemon, event):
    """A job's part is not sent again in the new session (its request names the old
    session's pool id): it fails with the given-up channel's session_gone NotFoundError. Before,
    the part failed with an UnavailableError saying the daemon was stopping ("started") or
    with the error of a closed client ("unstarted"), and the client was neither."""
    with Client(daemon.address, timeout_s=3) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        old_session = client.session_id
        landed: list[str] = []

        def at_event(frame: FrameType, traced: str, arg: Any) -> Any:
            if traced == event:
                sys.settrace(None)
                landed.append(event)
                give_up_and_close(client)
            return None

        def give_up(frame: FrameType, traced: str, arg: Any) -> Any:
            if traced != "call" or not in_grpc_call_on(frame, (GRPC_CHANNEL, "future")):
                return None
            return at_event(frame, traced, arg) if event == "call" else at_event

        assert daemon.proc is not None
        # No answer before the close: a Get answered between its start and the close ended
        # DONE, as nothing gave it up (1 run in 6 here).
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            sys.settrace(give_up)
            try:
                load = client.submit_load(pool, [LoadSegment(pool.binding.keys(TOKENS), [2, 3])])
            finally:
                sys.settrace(None)
            status = load.wait(30)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert landed
        assert status.finished
        assert isinstance(status.error, NotFoundError)
        assert "gave it up" in str(status.error)
        assert old_session in str(status.error)
        # A Get the close ended may still be copying on the daemon, as after a lost
        # connection (before, pages_reusable was True for it); one never sent is not.
        assert status.pages_reusable is (event == "call")
        assert client.session_id != old_session
        assert ends_in_time(lambda: pool.load(TOKENS, [2, 3])) == 8


def test_regression_a_call_past_its_deadline_is_not_sent_again_for_another_interrupt(daemon):
    """A call whose deadline passed (DEADLINE_EXCEEDED, the call's own answer) while another
    thread's interrupt gave its channel up fails with that error, as on a client nobody
    interrupted. Before, it was taken for a call that closing the channel ended and sent
    again in the new session with a new timeout: the caller waited past its timeout_s, and
    a call the daemon had run late (which DEADLINE_EXCEEDED does not rule out; a Delete)
    ran twice, the second answer saying that the keys the first deleted were missing."""
    with stored(daemon, timeout_s=1) as (client, pool, pid):
        keys = pool.binding.keys(TOKENS)
        landed: list[bool] = []

        def give_up(frame: FrameType, event: str, arg: Any) -> Any:
            if event != "call" or not in_grpc_call_on(frame, ("sync.py", "error_of")):
                return None
            sys.settrace(None)
            landed.append(True)
            client.interrupted(KeyboardInterrupt())  # as another thread's interrupt does
            os.kill(pid, signal.SIGCONT)
            return None

        os.kill(pid, signal.SIGSTOP)  # the Delete goes unanswered past its deadline
        sys.settrace(give_up)
        try:
            with pytest.raises(DeadlineExceededError):
                client.delete(keys)
        finally:
            sys.settrace(None)
            os.kill(pid, signal.SIGCONT)
        assert landed
        assert ends_in_time(client.health)


def test_regression_a_jobs_part_past_its_deadline_says_so_after_another_interrupt(
    daemon, monkeypatch
):
    """A job's part whose deadline passed (DEADLINE_EXCEEDED: the daemon may still copy into
    its pages) on a channel another thread's interrupt gave up fails with that error, which
    ``unclean`` says may have left a copy running. Before, it failed with the given-up
    session's NotFoundError, which ``unclean`` reads as answered: an engine would reuse
    pages a late copy could still write (``pages_reusable`` True)."""
    with Client(daemon.address, timeout_s=1) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        assert daemon.proc is not None
        pid = daemon.proc.pid
        job_ended = threading.Event()
        held: list[str] = []

        end_channel = sync_module._end_channel

        def hold_the_close(channel: Any, session_call: Any) -> None:
            # The given-up channel's closing thread waits for the job's end: the Get ends by
            # its deadline, not by the close. (Replaced in the module, not traced: a trace
            # reaches only threads started after it.)
            held.append(threading.current_thread().name)
            job_ended.wait(30)
            end_channel(channel, session_call)

        monkeypatch.setattr(sync_module, "_end_channel", hold_the_close)
        os.kill(pid, signal.SIGSTOP)  # the job's Get goes unanswered past its deadline
        try:
            load = client.submit_load(pool, [LoadSegment(pool.binding.keys(TOKENS), [2, 3])])
            try:
                client.interrupted(KeyboardInterrupt())  # as another thread's interrupt does
                status = load.wait(30)
            finally:
                job_ended.set()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert held == ["kvtier-discarded"]
        assert status.finished
        assert isinstance(status.error, DeadlineExceededError), status.error
        assert unclean(status.error)
        assert not status.pages_reusable
        assert ends_in_time(client.health)


def test_regression_a_session_given_up_with_grpcs_lock_held_stayed_open_in_the_daemon(
    daemon_factory,
):
    """The given-up channel's session stayed open in the daemon until the process exited,
    with its lease (until it expired) and its pool, one of server.max_sessions_per_tenant:
    with a limit of 2 and another client open, the client's next call was refused
    (RESOURCE_EXHAUSTED). Its next OpenSession now names the given-up session, which the
    daemon ends first."""
    d = daemon_factory("server.max_sessions_per_tenant=2")
    with (
        d.client(timeout_s=3) as client,
        d.client(timeout_s=3) as observer,
        SharedMemoryPool.for_layout(LAYOUT) as shm,
    ):
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        given_up = client.session_id
        interrupt_in_grpcs_lock("create", pinning_lookup, client, pool)
        gauges = observer.stats().gauges
        assert (gauges["sessions"], gauges["leases"], gauges["pools"]) == (2, 1, 1)
        assert ends_in_time(lambda: client.lookup(pool.binding.keys(TOKENS)).prefix_len) == 2
        assert client.session_id != given_up
        gauges = observer.stats().gauges
        assert (gauges["sessions"], gauges["leases"], gauges["pools"]) == (2, 0, 0)
        assert ends_in_time(lambda: pool.load(TOKENS, [2, 3])) == 8


def test_close_ends_the_wait_of_a_session_another_thread_opens(daemon):
    """close() names the sessions its client gave up in a session of its own
    (``_name_given_up``), but never waits for the session another thread opens: closing the
    channel ends that wait, as before that change, rather than the client's timeout."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    client = Client(daemon.address, timeout_s=120)
    assert client.health()  # connected: the wait below is the OpenSession's, not the connect's
    sending = threading.Event()
    opening: list[BaseException] = []

    def stop_the_daemon(frame: FrameType, event: str, arg: Any) -> None:
        # Its ticket fetched: the OpenSession goes unanswered.
        if event == "call" and in_grpc_call_on(frame, ("sync.py", "_send_open_session")):
            sys.settrace(None)
            os.kill(pid, signal.SIGSTOP)
            sending.set()

    def open_session() -> None:
        sys.settrace(stop_the_daemon)
        try:
            opening.append(raised_by(client.stats))
        finally:
            sys.settrace(None)

    opener = threading.Thread(target=open_session)
    opener.start()
    try:
        assert sending.wait(30)
        ends_in_time(client.close)
        opener.join(30)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not opener.is_alive()
    assert "closed" in str(opening[0])


def raised_by(call: Callable[[], Any]) -> BaseException:
    """What ``call()`` raised (AssertionError where it returned)."""
    try:
        call()
    except BaseException as e:
        return e
    return AssertionError(f"{call} returned")


def settled_gauges(observer: Client, bound_s: float = 30.0) -> tuple[float, float, float]:
    """The daemon's (sessions, leases, pools) once only ``observer``'s session is open, or
    after ``bound_s`` (a session's end reaches the daemon a moment after its client's)."""
    deadline = time.monotonic() + bound_s
    while True:
        gauges = observer.stats().gauges
        if gauges["sessions"] == 1 or time.monotonic() > deadline:
            return gauges["sessions"], gauges["leases"], gauges["pools"]
        time.sleep(0.02)


def test_regression_a_session_given_up_stayed_open_when_its_client_closed_next(daemon):
    """A client closed after giving up a channel an interrupt left locked, before any other
    call, never named that session: the daemon kept it, its lease and its pool until the
    process exited. Its close() now names it, in a session opened for that."""
    with (
        daemon.client(timeout_s=3) as observer,
        Client(daemon.address, timeout_s=3) as client,
        SharedMemoryPool.for_layout(LAYOUT) as shm,
    ):
        pool = client.register_pool(shm, LAYOUT, NS)
        assert pool.store(TOKENS, [0, 1]) == 8
        interrupt_in_grpcs_lock("create", pinning_lookup, client, pool)
        gauges = observer.stats().gauges
        assert (gauges["sessions"], gauges["leases"], gauges["pools"]) == (2, 1, 1)
        ends_in_time(client.close)
        assert settled_gauges(observer) == (1, 0, 0)
        assert client._given_up == []


@pytest.fixture
def ends_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The given-up channels and calls are ended only at the test's end, as where the
    interrupt left a lock held that their ends take (there, never): the stream of the
    session the client never knew stays open, whatever the lock held."""
    release = threading.Event()

    def held(end: Callable[..., None]) -> Callable[..., None]:
        def end_at_release(*objects: Any) -> None:
            release.wait()
            end(*objects)

        return end_at_release

    monkeypatch.setattr(sync_module, "_end_channel", held(sync_module._end_channel))
    monkeypatch.setattr(sync_module, "_cancel_calls", held(sync_module._cancel_calls))
    try:
        yield
    finally:
        release.set()


def test_regression_a_session_opened_as_an_interrupt_left_grpcs_lock_held_stayed_open(
    daemon_factory, ends_held
):
    """An interrupt that lands as the OpenSession's wait for its first event leaves gRPC's
    lock (the event taken, the lock held) gave up a session the daemon had opened and whose
    id the client never read: nothing could name it, so it stayed open until the process
    exited, one of server.max_sessions_per_tenant; with a limit of 2 and another client
    open, the client's next call was refused (RESOURCE_EXHAUSTED). The next OpenSession now
    names the given-up one's credential ticket, and the daemon ends the session it opened."""
    d = daemon_factory("server.max_sessions_per_tenant=2")
    with d.client(timeout_s=3) as client, d.client(timeout_s=3) as observer:
        assert observer.stats().gauges["sessions"] == 1
        interrupt_as_first_event_taken(lambda: client.session_id)
        assert observer.stats().gauges["sessions"] == 2  # the one the interrupt ended
        assert client.lookup([bytes(32)]).prefix_len == 0  # RESOURCE_EXHAUSTED before
        assert observer.stats().gauges["sessions"] == 2


def test_regression_a_session_opened_as_an_interrupt_left_grpcs_lock_held_outlived_close(
    daemon, ends_held
):
    """A client closed next, after an interrupt ended its OpenSession as above, did not
    name that OpenSession's ticket: close() names what the client gave up only where it
    gave up a session's id, so the session the daemon had opened stayed open until the
    process exited. close() now names given-up tickets too."""
    with daemon.client(timeout_s=3) as observer:
        client = Client(daemon.address, timeout_s=3)
        interrupt_as_first_event_taken(lambda: client.session_id)
        assert observer.stats().gauges["sessions"] == 2  # the one the interrupt ended
        ends_in_time(client.close)
        assert settled_gauges(observer, bound_s=5)[0] == 1  # 2 before
        assert client._given_up_tickets == []


# A client interrupted as gRPC's latency hook enters its context (grpc/_observability.py
# get_plugin, its process-wide RLock taken at the yield): the interrupt raised at the
# __enter__'s return, an opcode boundary, as a signal's handler raises; the error then kept in
# a cycle and collected on another thread. Prints what its next calls answered.
PLUGIN_LOCK_INTERRUPT = """
import contextlib, dis, gc, inspect, os, sys, threading
from kvtier.client import Client

def at_return(frame, event, arg):
    frame.f_trace_opcodes = True
    if event == "opcode" and frame.f_code.co_code[frame.f_lasti] == dis.opmap["RETURN_VALUE"]:
        if inspect.getgeneratorstate(frame.f_locals["self"].gen) == inspect.GEN_SUSPENDED:
            sys.settrace(None)
            raise KeyboardInterrupt
    return at_return

def trace(frame, event, arg):
    if frame.f_code is contextlib._GeneratorContextManager.__enter__.__code__:
        if frame.f_locals["self"].gen.__name__ == "get_plugin":
            return at_return(frame, event, arg)

def answer(call):
    result = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(10)
    return result

with Client(sys.argv[1], timeout_s=3) as client:
    client.health()
    gc.disable()
    sys.settrace(trace)
    try:
        client.lookup([bytes(32)])
    except KeyboardInterrupt as e:
        kept = [e]
        kept.append(kept)
    finally:
        sys.settrace(None)
    print("interrupted", bool(kept), flush=True)
    del kept
    collection = threading.Thread(target=gc.collect)
    collection.start()
    collection.join()
    print("lookup", answer(lambda: client.lookup([bytes(32)]).prefix_len), flush=True)
    print("new client", answer(lambda: Client(sys.argv[1], timeout_s=3).health()), flush=True)
    os._exit(0)  # its exit would wait for that lock too
"""


def test_regression_an_interrupt_as_grpcs_latency_hook_took_its_lock_hung_every_call(daemon):
    """gRPC's latency hook holds a process-wide RLock from its context's __enter__ to its
    __exit__; an interrupt between them left the generator holding it at its yield, and a
    collection on another thread ended it there (RuntimeError: cannot release un-acquired
    lock), so the lock stayed held: every channel's thread waits for it as each call ends,
    and no call of the process ended again, a new client's neither (seen in the SIGINT
    storm, a worker hung past its client's timeout). Run in a process of its own, which that
    lock would hang for good. The client now ends such a context on the interrupted thread."""
    out = subprocess.run(
        [sys.executable, "-c", PLUGIN_LOCK_INTERRUPT, daemon.address],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert out.splitlines() == ["interrupted True", "lookup [0]", "new client [True]"], out


def test_regression_close_after_a_ctrl_c_on_a_hung_daemon_waited_for_the_clients_timeout(
    daemon,
):
    """A Ctrl-C in a call's wait on a hung daemon, then close() (a ``with`` block's exit, as
    the Ctrl-C leaves it): close() named the given-up session first, in a session it opened
    on that daemon, and so waited for the client's whole timeout (120 s here) before it
    closed anything. The naming runs on a thread of its own, on a channel of its own; the
    session still ends once the daemon answers again."""
    with daemon.client(timeout_s=3) as observer, stored(daemon, 120) as (client, pool, pid):

        def ctrl_c(frame: FrameType, event: str, arg: Any) -> None:
            if event == "call" and in_grpc_call_on(frame, (GRPC_COMMON, "_wait_once")):
                sys.settrace(None)
                raise KeyboardInterrupt

        os.kill(pid, signal.SIGSTOP)
        try:
            interrupted_under(ctrl_c, pinning_lookup, client, pool)
            assert client._given_up
            ends_in_time(client.close)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert settled_gauges(observer)[0] == 1


def test_regression_an_interrupt_as_the_client_ended_entered_contexts_kept_the_channel(
    daemon, monkeypatch
):
    """interrupted() ended the contexts an interrupt entered (end_entered_contexts) before
    it marked the channel suspect: a second interrupt there (a SIGINT storm's), or an error
    of a context's end, left the mark unset, so the client kept the channel the first one
    may have left locked, and its next call used it. The mark comes first again."""
    with daemon.client(timeout_s=3) as client:
        client.health()
        channel = client._channel

        def interrupted_again(error: BaseException) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(sync_module, "end_entered_contexts", interrupted_again)
        with pytest.raises(KeyboardInterrupt):
            client.interrupted(KeyboardInterrupt())
        monkeypatch.undo()
        assert client.lookup([bytes(32)]).prefix_len == 0
        assert client._channel is not channel  # the same channel before


# Another process's client: prints its session's id, then, once told, its session's id again.
OTHER_PROCESS = """
import sys
from kvtier.client import Client
with Client(sys.argv[1], timeout_s=10) as client:
    print(client.session_id, flush=True)
    sys.stdin.readline()
    print(client.session_id, flush=True)
"""


def test_an_open_session_naming_another_process_or_tenants_session_ends_nothing(
    daemon_factory, tmp_path
):
    """A session id acts as its session from any connection, but given_up_sessions ends only
    sessions of the same process and tenant: naming another process's session, a session
    of this process bound to another tenant, or ids that are no session's, ends nothing and
    fails nothing."""
    token, tenants = tenant_token(tmp_path, "other")
    d = daemon_factory(tenants)
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_PROCESS, d.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdin is not None
        other_process = other.stdout.readline().strip()
        with (
            d.client(token_file=token) as other_tenant,
            d.client(timeout_s=3) as hostile,
        ):
            theirs = other_tenant.session_id
            hostile._given_up += [other_process, theirs, "0" * 32, "not a session"]
            assert hostile.stats().gauges["sessions"] == 3
            assert hostile._given_up == []  # sent
            assert other_tenant.session_id == theirs
            assert other_tenant.stats().gauges["sessions"] == 3
        out, _ = other.communicate("\n", timeout=30)
        assert out.strip() == other_process
    finally:
        other.kill()
        other.wait()


# Run in an interpreter of its own: a collection that never ends is shared by every later
# test of the process (each gc.collect() then returns at once).
_COLLECTED_AFTER_AN_INTERRUPT = """
import gc, os, sys, threading, weakref
from kvtier.client import Client, Namespace, PoolLayout, SharedMemoryPool

address, where = sys.argv[1:]
NS = Namespace(model="interrupted-channels", kv_dtype="uint8", block_tokens=4)
LAYOUT = PoolLayout.staging(num_layers=2, num_pages=4, block_tokens=4, chunk_bytes=64)
TOKENS = list(range(8))


def interrupt(frame, event, arg):
    caller = frame.f_back
    if (
        event == "call"
        and frame.f_code.co_name == "__exit__"
        and frame.f_code.co_filename == threading.__file__
        and caller is not None
        and caller.f_code.co_filename.endswith(os.path.join("grpc", "_channel.py"))
        and caller.f_code.co_name == where
    ):
        sys.settrace(None)
        raise KeyboardInterrupt


def interrupted(call):
    sys.settrace(interrupt)
    try:
        call()
    except KeyboardInterrupt as e:
        caught = e  # in a cycle with this frame, as pytest.raises or a saved error keeps it
        return caught is not None
    finally:
        sys.settrace(None)
    return False


class Node:
    pass


with Client(address, timeout_s=3) as client, SharedMemoryPool.for_layout(LAYOUT) as shm:
    pool = client.register_pool(shm, LAYOUT, NS)
    assert pool.store(TOKENS, [0, 1]) == 8
    keys = pool.binding.keys(TOKENS)
    if where == "result":  # the wait for a pinning Lookup's answer
        assert interrupted(lambda: client.lookup(keys, pin=True, lease_ms=600_000))
    else:  # the wait for a new session's first answer
        assert interrupted(Client(address, timeout_s=3).stats)
    # A collection on another thread than the one the interrupt left holding the call's lock.
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(10)
    a, b = Node(), Node()
    a.other, b.other = b, a
    cycle = weakref.ref(a)
    del a, b
    gc.collect()
    print(f"collection ended: {not collector.is_alive()}, cycle collected: {cycle() is None}")
    sys.stdout.flush()
    os._exit(0)  # the interrupted call's lock is held for good: no orderly exit
"""


@pytest.mark.parametrize("where", ["result", "_next"], ids=["lookup-answer", "session-answer"])
def test_regression_a_call_an_interrupt_ended_never_stops_the_garbage_collector(daemon, where):
    """An interrupt that lands as gRPC leaves the lock of the call it waited on (a pinning
    Lookup's answer, a new session's first one) leaves that lock held; the client drops the
    call, and gRPC's finalizer of it takes that lock. Run by a collection on another thread
    (the call kept alive by a cycle through the interrupt's traceback, as a saved error
    makes one), it waited for ever, and every later gc.collect() returned at once: the
    cycle made afterwards was never collected. The client now keeps such calls for good."""
    proc = subprocess.run(
        [sys.executable, "-c", _COLLECTED_AFTER_AN_INTERRUPT, daemon.address, where],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "collection ended: True, cycle collected: True" in proc.stdout, proc.stdout
