"""The L1 arena's pre-fault: in the background once asked, stoppable, never in the way."""

from __future__ import annotations

from kvtier.tiers.host import HostArena


def test_background_prefault_runs_once_started_and_the_arena_works_meanwhile():
    arena = HostArena(64 << 20, 16 << 20, prefault="background")
    assert not arena.prefaulted.is_set()  # nothing happens before start_prefault()
    slot = arena.allocator.allocate(4096)
    assert slot is not None
    arena.view(slot, 4096)[:] = b"x" * 4096  # usable before its pages were faulted in
    arena.start_prefault()
    arena.start_prefault()  # idempotent
    assert arena.prefaulted.wait(30)
    assert arena.view(slot, 4096) == b"x" * 4096
    arena.close()


def test_closing_stops_a_prefault_in_progress():
    arena = HostArena(256 << 20, 64 << 20, prefault="background")
    arena.start_prefault()
    arena.close()  # joins the thread: nothing touches the mapping after it is closed
    assert arena._prefaulter is None
