"""A client that reads nothing holds up nothing but its own calls.

A gRPC answer waits for its client's flow-control window; a client that never grants one (an
HTTP/2 SETTINGS of window 0, then no WINDOW_UPDATE) leaves the daemon's writes to it pending
for as long as its connection stays open. Such a pending write must hold no lock or state
that another call, a status change or the stop needs. This test speaks HTTP/2 itself
(tests/h2_frames.py): gRPC clients grant their windows.
"""

from __future__ import annotations

from h2_frames import RawConnection, grpc_prefix

WATCH = "/grpc.health.v1.Health/Watch"


def test_regression_a_health_watch_that_read_nothing_held_drain_and_stop(daemon_factory):
    """grpc_health's servicer wrote a watcher's answer while holding the lock every status
    change takes. A watch (it needs no session) whose client granted no window kept that lock
    for as long as its connection stayed open: a Drain and its resume never answered, and a
    SIGTERM never got past setting NOT_SERVING, so the daemon did not stop at all until the
    client left. Now status changes wait for no watcher."""
    daemon = daemon_factory("server.drain_timeout_s=0.5")
    conn = RawConnection(daemon.socket, initial_window=0)
    stream = conn.open_call(WATCH)
    conn.send(stream, grpc_prefix(0), end=True)  # HealthCheckRequest(service=""), empty
    conn.pump(0.3)  # the watch is open; its first answer cannot be sent
    assert not conn.closed and stream not in conn.reset
    with daemon.client(timeout_s=5) as client:
        assert client.drain().draining
        assert not client.health()
        assert not client.drain(resume=True).draining
        assert client.health()
    assert daemon.stop(timeout_s=10) == 0  # with the connection still open
    conn.close()
    assert "kvtierd stopped" in daemon.log()
