"""The HTTP health probes on the metrics endpoint: /healthz (the event loop answers) and
/readyz (the daemon serves), without the metrics token and without a gRPC connection."""

from __future__ import annotations

import asyncio
import http.client
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from h2_frames import RawConnection, grpc_prefix
from harness import entry_setting
from prometheus_client import CollectorRegistry, Gauge

from kvtier.daemon import metrics
from kvtier.daemon.health import HealthService
from kvtier.daemon.probes import HealthProbe, ProbeState, probe_state
from kvtier.tiers.base import HEALTHY, Health, TierHealth, TierKind

CHECK_INTERVAL_S = 0.2


def base_url(daemon) -> str:
    m = re.search(r"metrics on (http://\S+)/metrics", daemon.log())
    assert m, daemon.log()
    return m.group(1)


def get(url: str, method: str = "GET", token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method)
    if token is not None:
        request.add_header("Authorization", "Bearer " + token)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def call(app: HealthProbe | metrics.ProbeRouter, path: str, method: str = "GET") -> tuple[str, str]:
    got: list[str] = []
    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": method}, lambda s, h: got.append(s)))
    return got[0], body.decode()


def test_probes_answer_without_the_metrics_token(daemon_factory, tmp_path):
    """The token keeps tenants' figures private; the probes tell only whether the daemon
    serves and each tier's state, and an orchestrator's probe carries no secret."""
    token = tmp_path / "metrics.token"
    token.write_text("s3cret-" * 6)
    token.chmod(0o600)
    d = daemon_factory(f"metrics.token_file={token}", "metrics.address=127.0.0.1:0")
    url = base_url(d)
    assert get(url + "/healthz") == (200, "alive; L1 ok\n")
    assert get(url + "/readyz") == (200, "ok: serving; L1 ok\n")
    code, body = get(url + "/metrics")
    assert code == 401 and "kvtier_" not in body
    assert get(url + "/metrics", token="s3cret-" * 6)[0] == 200
    assert get(url + "/healthz", method="POST")[0] == 405
    assert get(url + "/readyz", method="HEAD") == (200, "")


def test_readyz_answers_503_while_the_daemon_drains(daemon_factory):
    d = daemon_factory("metrics.address=127.0.0.1:0")
    url = base_url(d)
    with d.client() as admin:
        admin.drain()
        time.sleep(0.3)  # past the reuse interval
        assert get(url + "/readyz") == (503, "not serving (draining or stopping); L1 ok\n")
        assert get(url + "/healthz") == (200, "alive; L1 ok\n")  # draining is alive
        admin.drain(resume=True)
        time.sleep(0.3)
        assert get(url + "/readyz") == (200, "ok: serving; L1 ok\n")


def test_probes_answer_while_a_client_holds_every_grpc_connection(daemon_factory):
    """`kvtier health` needs one of server.max_connections: a client that holds them all made
    an exec probe fail, and a liveness probe restart a daemon that was serving."""
    # The daemon counts its connections every 0.2 s rather than 5 s (the count and the
    # warning are the same; the wait for them shorter).
    d = daemon_factory(
        "server.max_connections=4",
        "metrics.address=127.0.0.1:0",
        entry=entry_setting({"kvtier.daemon.connections.CHECK_INTERVAL_S": CHECK_INTERVAL_S}),
    )
    url = base_url(d)
    conns: list[RawConnection] = []
    try:
        for _ in range(40):  # until four are held (one more is closed as it is accepted)
            if sum(not conn.closed for conn in conns) >= 4:
                break
            try:
                conn = RawConnection(d.socket, initial_window=0)
                conn.send(conn.open_call("/grpc.health.v1.Health/Check"), grpc_prefix(0), end=True)
            except OSError:
                continue
            conns.append(conn)
            for conn in conns:
                conn.pump(0.05)
        assert sum(not conn.closed for conn in conns) == 4
        env = {**os.environ, "KVTIER_ADDRESS": d.address}
        # Unreachable is the timeout waited out: 1 s tells it as well as 3 s did.
        cli = [sys.executable, "-m", "kvtier.cli.main", "--timeout", "1", "health"]
        out = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 3, (out.stdout, out.stderr)  # unreachable over gRPC
        assert get(url + "/healthz") == (200, "alive; L1 ok\n")
        assert get(url + "/readyz") == (200, "ok: serving; L1 ok\n")
        # gRPC refuses the rest without telling the daemon, which counts its connections.
        deadline = time.monotonic() + 10
        while "server.max_connections is 4" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "4 gRPC connections open, server.max_connections is 4" in d.log()
        code, text = get(url + "/metrics")
        assert code == 200 and "\nkvtier_connections 4.0\n" in text
    finally:
        for conn in conns:
            conn.close()


@pytest.fixture
def loop_thread():
    """An event loop running on a thread of its own, as the daemon's is to the HTTP server."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


SERVING = ProbeState(serving=True, tiers=(("L1", "ok"), ("L2", "ok")))


def test_a_loop_that_does_not_answer_fails_both_probes(loop_thread):
    probe = HealthProbe(lambda: SERVING, loop_thread, timeout_s=0.2, reuse_s=0.0)
    assert call(probe, "/healthz") == ("200 OK", "alive; L1 ok, L2 ok\n")
    release = threading.Event()
    loop_thread.call_soon_threadsafe(release.wait, 10)  # the loop stuck in a call
    try:
        for path in ("/healthz", "/readyz"):
            status, body = call(probe, path)
            assert status == "503 Service Unavailable"
            assert body == "the daemon's event loop did not answer within 0.2 s\n"
    finally:
        release.set()
    assert call(probe, "/healthz")[0] == "200 OK"


def test_a_closed_loop_fails_the_probes():
    loop = asyncio.new_event_loop()
    loop.close()
    probe = HealthProbe(lambda: SERVING, loop, timeout_s=0.2)
    assert call(probe, "/healthz") == (
        "503 Service Unavailable",
        "the daemon's event loop has stopped\n",
    )


def test_a_state_that_cannot_be_read_fails_the_probes(loop_thread):
    def broken() -> ProbeState:
        raise OSError(5, "Input/output error")

    probe = HealthProbe(broken, loop_thread)
    status, body = call(probe, "/healthz")
    assert status == "503 Service Unavailable"
    assert body == "reading the daemon's state failed (OSError)\n"  # no path, no message


def test_readyz_names_a_degraded_tier_and_stays_ready(loop_thread):
    state = ProbeState(serving=True, tiers=(("L1", "ok"), ("L2", "degraded_io")))
    probe = HealthProbe(lambda: state, loop_thread)
    assert call(probe, "/readyz") == ("200 OK", "degraded: serving; L1 ok, L2 degraded_io\n")


def test_the_probes_show_each_tier_s_state_without_its_detail():
    """A tier's detail may name its files or its remote store; the probes answer whoever
    reaches the port, so they say the state only."""
    l1 = SimpleNamespace(kind=TierKind.HOST, tier=SimpleNamespace(health=lambda: HEALTHY))
    sick = TierHealth(Health.DOWN, "redis://10.0.0.7:6379 unreachable")
    l3 = SimpleNamespace(kind=TierKind.REMOTE, tier=SimpleNamespace(health=lambda: sick))
    health = HealthService()
    daemon = SimpleNamespace(health=health, store=SimpleNamespace(stack=[l1, l3]))
    assert probe_state(daemon) == ProbeState(True, (("L1", "ok"), ("L3", "down")))


def test_an_answer_is_reused_within_the_reuse_interval_only(loop_thread):
    now = [0.0]
    asked = []

    def ask() -> ProbeState:
        asked.append(now[0])
        return SERVING

    probe = HealthProbe(ask, loop_thread, reuse_s=0.2, clock=lambda: now[0])
    for t in (0.0, 0.1, 0.19, 0.2, 0.3, 0.5):
        now[0] = t
        assert call(probe, "/readyz")[0] == "200 OK"
    assert asked == [0.0, 0.2, 0.5]


def routed(probe: HealthProbe) -> metrics.ProbeRouter:
    """``probe`` behind the endpoint's router, which takes the methods for every path."""
    return metrics.ProbeRouter(metrics.scrape_app(CollectorRegistry()), probe)


def test_probes_refuse_other_methods(loop_thread):
    probe = HealthProbe(lambda: SERVING, loop_thread)
    assert call(routed(probe), "/healthz", method="DELETE")[0] == "405 Method Not Allowed"


def test_regression_probes_that_came_together_waited_for_the_loop_one_after_another(loop_thread):
    """A probe that came while another waited for the event loop waited for the lock, then
    asked the loop again and waited its own timeout: the n-th of n probes at a stuck loop
    answered after n timeouts (the third one after the kubelet's own 5 s), and each held a
    thread of the HTTP server that long. Those that come together share one request to the
    loop, and its answer."""
    probe = HealthProbe(lambda: SERVING, loop_thread, timeout_s=2.0, reuse_s=0.0)
    release = threading.Event()
    loop_thread.call_soon_threadsafe(release.wait, 30)  # the loop stuck in a call
    together = threading.Barrier(4)
    answers: queue.Queue[tuple[str, str]] = queue.Queue()

    def ask() -> None:
        together.wait()
        answers.put(call(probe, "/healthz"))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        first = answers.get(timeout=30)
    finally:
        release.set()  # the loop answers again once the first probe has its 503
    for thread in threads:
        thread.join(30)
    rest = [answers.get_nowait() for _ in range(3)]
    expected = ("503 Service Unavailable", "the daemon's event loop did not answer within 2 s\n")
    assert [first, *rest] == [expected] * 4
    assert call(probe, "/healthz")[0] == "200 OK"


def test_regression_a_probe_at_a_path_slightly_off_was_answered_by_the_scrape(loop_thread):
    """Every path but the probes' went to the scrape, which prometheus_client serves at any
    path: without metrics.token_file, a readiness probe set to /readyz/ (or /ready) got 200
    while the daemon drained. Paths other than /metrics and the probes' are 404."""
    draining = ProbeState(serving=False, tiers=(("L1", "ok"),))
    probe = HealthProbe(lambda: draining, loop_thread)
    server, thread = metrics.serve_http(
        "127.0.0.1", 0, metrics.ProbeRouter(metrics.scrape_app(CollectorRegistry()), probe)
    )
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert get(url + "/readyz")[0] == 503
        assert get(url + "/readyz?verbose=1")[0] == 503  # the query is not the path
        assert get(url + "/metrics")[0] == 200
        for path in ("/readyz/", "/ready", "/", "/healthz/x", "/metrics/"):
            code, body = get(url + path)
            assert (code, body) == (
                404,
                "not found: this endpoint serves /metrics, /healthz and /readyz\n",
            ), path
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_regression_head_on_the_scrape_was_answered_405_with_a_body(loop_thread):
    """prometheus_client's app answers only GET (and OPTIONS): a HEAD of /metrics got 405
    with a body, a POST was served its 405 through the token check and the scrape's pace.
    Every path answers GET and HEAD, a HEAD with the GET's status and headers and no body,
    and any other method 405 with the methods allowed."""
    probe = HealthProbe(lambda: SERVING, loop_thread)
    registry = CollectorRegistry()
    Gauge("kvtier_example", "A gauge to scrape.", registry=registry).set(1)
    router = metrics.ProbeRouter(metrics.scrape_app(registry), probe)
    server, thread = metrics.serve_http("127.0.0.1", 0, router)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code, scrape = get(url + "/metrics")
        assert code == 200 and "kvtier_example 1.0" in scrape
        request = urllib.request.Request(url + "/metrics", method="HEAD")
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            assert resp.read() == b""
        assert get(url + "/nowhere", method="HEAD") == (404, "")
        for method in ("POST", "OPTIONS", "DELETE"):
            for path in ("/metrics", "/nowhere"):
                request = urllib.request.Request(url + path, method=method)
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(request, timeout=10)
                assert refused.value.code == 405, (method, path)
                assert refused.value.headers["Allow"] == "GET, HEAD"
                assert refused.value.read() == b"GET or HEAD only\n"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _length(url: str, method: str, headers: dict[str, str]) -> tuple[int, str | None, int]:
    """The status, Content-Length header and body length of one request."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, "/metrics", headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Length"), len(resp.read())
    finally:
        conn.close()


def test_regression_head_on_the_scrape_claimed_an_empty_body(loop_thread):
    """A HEAD of /metrics was answered with ``Content-Length: 0`` (wsgiref's default for an
    answer without a body and without the header), a 401 as well, while the GET's body was
    thousands of bytes: HTTP forbids a Content-Length on a HEAD answer other than the GET's.
    The HEAD's is the GET's, for the scrape (plain or gzip) and for a refused token."""
    probe = HealthProbe(lambda: SERVING, loop_thread)
    registry = CollectorRegistry()
    Gauge("kvtier_example", "A gauge to scrape.", registry=registry).set(1)
    token = "t" * 32
    router = metrics.ProbeRouter(metrics.scrape_app(registry, token.encode()), probe)
    server, thread = metrics.serve_http("127.0.0.1", 0, router)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        bearer = {"Authorization": "Bearer " + token}
        for headers, status in (
            (bearer, 200),
            ({**bearer, "Accept-Encoding": "gzip"}, 200),
            ({}, 401),
        ):
            code, length, size = _length(url, "GET", headers)
            assert (code, length) == (status, str(size)) and size > 0, headers
            assert _length(url, "HEAD", headers) == (status, length, 0), headers
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_refused_method_is_told_which_are_allowed(loop_thread):
    """HTTP requires an Allow header on a 405 answer."""
    probe = routed(HealthProbe(lambda: SERVING, loop_thread))
    got: list[tuple[str, list[tuple[str, str]]]] = []
    environ = {"PATH_INFO": "/readyz", "REQUEST_METHOD": "POST"}
    b"".join(probe(environ, lambda status, headers: got.append((status, headers))))
    ((status, headers),) = got
    assert status == "405 Method Not Allowed"
    assert ("Allow", "GET, HEAD") in headers
