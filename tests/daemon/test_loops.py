"""The daemon's event loop (``server.event_loop``, daemon/loops.py): uvloop by default,
asyncio's own on request, and a configured loop that cannot be imported stops the daemon
before it starts rather than running on the other one; work done on it a slice a turn
(``InTurns``) survives a slice that raises."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
import uvloop

from kvtier.daemon import loops
from kvtier.daemon.config import load_config
from kvtier.daemon.errors import ConfigError
from kvtier.daemon.stats import Counters

# A Python in which uvloop cannot be imported, running kvtierd with the given arguments.
NO_UVLOOP = (
    "import sys; sys.modules['uvloop'] = None; "
    "from kvtier.daemon.main import main; sys.exit(main(sys.argv[1:]))"
)


def _metrics_url(log: str) -> str:
    m = re.search(r"metrics on (http://\S+/metrics)", log)
    assert m, log
    return m.group(1)


def _build_info(url: str) -> dict[str, str]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "kvtier_build_info":
            (sample,) = fam.samples
            assert sample.value == 1
            return dict(sample.labels)
    raise AssertionError("no kvtier_build_info in the scrape")


def test_uvloop_is_the_default_and_other_names_are_refused():
    assert load_config(None, []).server.event_loop == "uvloop"
    assert load_config(None, ["server.event_loop=asyncio"]).server.event_loop == "asyncio"
    with pytest.raises(ConfigError, match=r"server\.event_loop"):
        load_config(None, ["server.event_loop=trio"])


def test_run_takes_the_named_loop():
    async def kind() -> str:
        return loops.running()

    assert loops.run(kind(), "uvloop") == "uvloop"
    assert loops.run(kind(), "asyncio") == "asyncio"
    assert loops.describe("uvloop") == f"uvloop {uvloop.__version__}"
    assert loops.describe("asyncio") == "asyncio"


def test_run_refuses_an_unknown_loop_and_closes_the_coroutine():
    async def never() -> None:
        raise AssertionError("ran")

    coro = never()
    with pytest.raises(ValueError, match="'trio'"):
        loops.run(coro, "trio")
    assert coro.cr_frame is None  # closed: no 'never awaited' warning, nothing ran


def test_a_missing_uvloop_stops_the_daemon_naming_the_key(tmp_path):
    assert loops.problem("uvloop") is None
    assert loops.problem("asyncio") is None
    # A socket of its own: the default one may be a daemon the user runs (`make run`), and
    # the check refuses a socket another daemon listens on.
    own = ["--set", f"server.socket={tmp_path}/s.sock"]
    proc = subprocess.run(
        [sys.executable, "-c", NO_UVLOOP, "--check-config", *own],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "server.event_loop: uvloop is not installed" in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            NO_UVLOOP,
            "--check-config",
            *own,
            "--set",
            "server.event_loop=asyncio",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "event loop: asyncio" in proc.stdout


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_the_daemon_serves_on_either_loop_and_says_which(daemon_factory, kind):
    d = daemon_factory(f"server.event_loop={kind}", "metrics.address=127.0.0.1:0")
    with d.client() as client:
        assert client.health()
        assert client.lookup([b"k" * 32]).prefix_len == 0
    shown = loops.describe(kind)
    assert f"({shown} event loop)" in d.log()
    assert _build_info(_metrics_url(d.log()))["event_loop"] == kind
    assert d.stop() == 0


def test_the_running_loop_is_named_from_inside():
    async def kind() -> str:
        return loops.running()

    assert asyncio.run(kind()) == "asyncio"
    assert uvloop.run(kind()) == "uvloop"


def test_work_in_turns_calls_its_step_once_a_turn_and_all_at_once_without_a_loop():
    """``InTurns``: the first call at once, each later one at a later turn of the running
    loop, other callbacks running between them, until the step answers False; without a
    running loop every call at once. A ``begin`` while under way adds no second chain."""
    calls: list[str] = []

    def step() -> bool:
        calls.append("step")
        return calls.count("step") < 3

    turns = loops.InTurns(step, "stepping", Counters())
    turns.begin()
    assert calls == ["step"] * 3 and not turns.due

    async def run() -> None:
        calls.clear()
        turns.begin()
        assert calls == ["step"] and turns.due
        turns.begin()
        turns.begin_soon()
        for _ in range(4):
            calls.append("turn")
            await asyncio.sleep(0)
        assert calls == ["step", "turn", "step", "turn", "step", "turn", "turn"]
        assert not turns.due
        calls.clear()
        turns.begin_soon()  # its first call at the next turn
        assert calls == [] and turns.due
        for _ in range(4):
            calls.append("turn")
            await asyncio.sleep(0)
        assert calls == ["turn", "step", "turn", "step", "turn", "step", "turn"]

    asyncio.run(run())
    calls.clear()
    turns.begin_soon()  # no loop: nothing until the next begin
    assert calls == [] and not turns.due


def test_a_step_that_raises_is_logged_counted_and_called_again_later(caplog):
    """A call of ``InTurns``' step that raises, at its first call or at a later turn, is
    logged and counted in background_errors, and the step is called again
    ``TURN_RETRY_S`` later (not at the next turn: a step that fails every time would log at
    the loop's rate), the work under way meanwhile; without a loop the work waits for the
    next ``begin``."""
    counters, calls = Counters(), []
    fail_at = {1, 3}

    def step() -> bool:
        calls.append("step")
        if len(calls) in fail_at:
            raise MemoryError("injected")
        return len(calls) < 5

    turns = loops.InTurns(step, "stepping", counters)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        later: list[tuple[float, Callable[[], object]]] = []
        loop.call_later = lambda delay, cb: later.append((delay, cb))  # type: ignore[method-assign,assignment]
        turns.begin()  # the first call fails
        assert calls == ["step"] and turns.due
        assert [x for x, _ in later] == [loops.TURN_RETRY_S]
        turns.begin()  # under way: nothing
        for _ in range(3):
            await asyncio.sleep(0)
        assert calls == ["step"]
        later.pop()[1]()  # TURN_RETRY_S later
        assert calls == ["step"] * 2
        await asyncio.sleep(0)  # the third, at the next turn, fails
        assert calls == ["step"] * 3 and len(later) == 1
        later.pop()[1]()
        for _ in range(3):
            await asyncio.sleep(0)
        assert calls == ["step"] * 5 and not turns.due and later == []

    with caplog.at_level(logging.ERROR, logger=loops.log.name):
        asyncio.run(run())
    assert counters.get("background_errors") == 2
    assert caplog.text.count("stepping failed; tried again in 1 s") == 2
    assert "MemoryError: injected" in caplog.text
    calls.clear()
    fail_at = {1}
    turns.begin()  # no loop: the work stays owed
    assert calls == ["step"] and not turns.due and counters.get("background_errors") == 3
    turns.begin()
    assert calls == ["step"] * 5
