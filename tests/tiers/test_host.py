"""The L1 arena's pre-fault: in the background once asked, stoppable, never in the way."""

from __future__ import annotations

from kvtier.tiers.host import HostArena


def test_background_prefault_runs_once_started_and_the_arena_works_meanwhile():
    arena = HostArena(64 << 20, 16 << 20, prefault="background")
    assert not arena.prefaulted.is_set()  # nothing happens before start_prefault()
    assert arena.stats().gauges["prefaulting"] == 1.0
    slot = arena.allocator.allocate(4096)
    assert slot is not None
    arena.view(slot, 4096)[:] = b"x" * 4096  # usable before its pages were faulted in
    arena.start_prefault()
    arena.start_prefault()  # idempotent
    assert arena.prefaulted.wait(30)
    assert arena.stats().gauges["prefaulting"] == 0.0  # what a bench waits for
    assert arena.view(slot, 4096) == b"x" * 4096
    arena.close()


def test_closing_stops_a_prefault_in_progress():
    arena = HostArena(256 << 20, 64 << 20, prefault="background")
    arena.start_prefault()
    arena.close()  # joins the thread: nothing touches the mapping after it is closed
    assert arena._prefaulter is None


def test_buffers_carry_each_views_own_address():
    """A disk tier trusts these to decide which views the kernel takes without staging."""
    import ctypes

    arena = HostArena(16 << 20, 16 << 20)
    slots = [arena.allocator.allocate(4096) for _ in range(5)]
    bufs = arena.buffers(slots, 4096)
    assert bufs.addresses is not None and len(bufs.addresses) == 5
    for view, address in zip(bufs.views, bufs.addresses, strict=True):
        assert ctypes.addressof(ctypes.c_char.from_buffer(view)) == address
        assert address % 4096 == 0
    arena.close()
