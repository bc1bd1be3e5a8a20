"""``kvtierd``'s entry point (``daemon/entry.py``): signals that arrive while the daemon starts.

Each test runs the console script's entry point (the one pyproject.toml names) in a real
process and has the daemon send itself the signal at one point of its start, so "the signal
arrived while the daemon imported its modules" is a state the test sets, not a race it
times. SIGHUP is a reload once the daemon serves (tests/test_reload.py); SIGINT and SIGTERM
stop it the way they stop a serving daemon: exit status 0, its sockets gone, "kvtierd
stopped" in its log.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from harness import DaemonProcess, catches_signal

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

# argv: the pyproject, the point, the signals' names (joined by '+', sent in that order), then
# kvtierd's own arguments. The point:
#   imports  as kvtier.daemon.main starts to be imported (the ~240 ms of heavy imports)
#   loop     as kvtier.daemon.server is imported: on the event loop, nothing bound yet
#   bound    as the store opens: the sockets are bound, the daemon does not serve yet
#   held     (none: the test signals the process once its entry point holds SIGHUP)
_ENTRY_SIGNALLING_ITSELF = """
import importlib, os, signal, sys, tomllib
from pathlib import Path

pyproject, point, name = sys.argv[1:4]
del sys.argv[1:4]
signums = [getattr(signal, n) for n in name.split("+")]

def send():
    for signum in signums:
        os.kill(os.getpid(), signum)

class SignalOnImport:
    def __init__(self, module):
        self.module = module

    def find_spec(self, name, path=None, target=None):
        if name == self.module:
            sys.meta_path.remove(self)
            send()
        return None

if point == "imports":
    sys.meta_path.insert(0, SignalOnImport("kvtier.daemon.main"))
elif point == "loop":
    sys.meta_path.insert(0, SignalOnImport("kvtier.daemon.server"))
elif point == "bound":
    from kvtier.daemon.store import BlockStore

    opening = BlockStore.open

    async def open_signalled(self, *args, **kwargs):
        send()
        return await opening(self, *args, **kwargs)

    BlockStore.open = open_signalled

scripts = tomllib.loads(Path(pyproject).read_text())["project"]["scripts"]
module, func = scripts["kvtierd"].split(":")
sys.exit(getattr(importlib.import_module(module), func)())
"""

START_S = 60.0


def _start(tmp_path: Path, daemon_factory, point: str, signals: str, *overrides: str):
    d = DaemonProcess(
        tmp_path,
        f"{daemon_factory._sockdir}/{point}.sock",
        ["--set=tiers.l1.capacity_bytes=64MiB", *overrides],
        entry=("-c", _ENTRY_SIGNALLING_ITSELF, str(PYPROJECT), point, signals),
    )
    daemon_factory._daemons.append(d)
    d.start(wait=False)
    return d


def _assert_stopped_cleanly(d: DaemonProcess) -> None:
    assert d.proc is not None
    try:
        code = d.proc.wait(START_S)
    except Exception:
        raise AssertionError(f"kvtierd did not stop:\n{d.log()}") from None
    log = d.log()
    assert code == 0, log
    assert "kvtierd stopped" in log and "Traceback" not in log, log
    assert not os.path.exists(d.socket) and not os.path.exists(d.socket + ".cred"), log


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("point", ["imports", "loop", "bound"])
def test_a_stop_signal_while_the_daemon_starts_stops_it_cleanly_once_it_would_serve(
    tmp_path, daemon_factory, point, sig
):
    """Regression: SIGTERM's default action ended a starting daemon at once (status -15,
    its sockets left behind, no log line), and SIGINT raised KeyboardInterrupt wherever the
    daemon was (a traceback from the imports, status 1; on the loop, status 0 with the
    sockets it had bound left behind). The entry point holds both from its start with
    SIGHUP; the daemon stops as a serving one does once it has started."""
    d = _start(tmp_path, daemon_factory, point, sig.name)
    _assert_stopped_cleanly(d)
    assert f"{sig.name} arrived while starting" in d.log()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_signal_as_soon_as_the_entry_point_holds_signals_stops_the_daemon_cleanly(
    tmp_path, daemon_factory, sig
):
    """The earliest a signal can be held: the entry point's first lines (before them, the
    interpreter's own start is left to the signal's default action)."""
    d = _start(tmp_path, daemon_factory, "held", sig.name)
    assert d.proc is not None
    deadline = time.monotonic() + START_S
    while not catches_signal(d.proc.pid, signal.SIGHUP):
        assert d.proc.poll() is None and time.monotonic() < deadline, d.log()
        time.sleep(0.001)
    d.proc.send_signal(sig)
    _assert_stopped_cleanly(d)


def test_a_stop_signal_while_the_daemon_starts_on_asyncio_s_loop_stops_it_cleanly(
    tmp_path, daemon_factory
):
    """The same on the standard library's event loop (server.event_loop: asyncio), whose
    runner takes SIGINT for itself unless a handler other than Python's default holds it."""
    d = _start(tmp_path, daemon_factory, "bound", "SIGINT", "--set=server.event_loop=asyncio")
    _assert_stopped_cleanly(d)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_second_stop_signal_while_the_daemon_starts_ends_it_at_once(
    tmp_path, daemon_factory, sig
):
    """The first stop signal is held until the daemon has started; a second is the operator
    not waiting for a start that may hang (Ctrl-C twice): the signal's default action then."""
    d = _start(tmp_path, daemon_factory, "bound", f"{sig.name}+{sig.name}")
    assert d.proc is not None
    assert d.proc.wait(START_S) == -sig, d.log()
    assert f"a second {sig.name} while starting: stopping at once" in d.log()
    assert "kvtierd stopped" not in d.log()


def test_a_sighup_and_a_sigterm_while_the_daemon_starts_stop_it_without_a_reload(
    tmp_path, daemon_factory
):
    """A stop noted while starting wins over a reload noted too: no config is read again."""
    d = _start(tmp_path, daemon_factory, "bound", "SIGHUP+SIGTERM")
    _assert_stopped_cleanly(d)
    assert "reading the config again" not in d.log() and "SIGHUP: " not in d.log()


# `python -m kvtier.daemon.main` (runpy's run as __main__, as -m does), with the signals of
# argv[1] sent as the module's first heavy import, kvtier.daemon.preflight, starts.
_MODULE_SIGNALLING_ITSELF = """
import os, runpy, signal, sys

signums = [getattr(signal, n) for n in sys.argv[1].split("+")]
del sys.argv[1]

class SignalOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == "kvtier.daemon.preflight":
            sys.meta_path.remove(self)
            for signum in signums:
                os.kill(os.getpid(), signum)
        return None

sys.meta_path.insert(0, SignalOnImport())
runpy.run_module("kvtier.daemon.main", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_regression_a_stop_signal_while_python_m_kvtier_daemon_main_imported_ended_it(
    tmp_path, daemon_factory, sig
):
    """``python -m kvtier.daemon.main`` ran the module's own imports (the heavy ones, ~240 ms)
    before its ``__main__`` block handed over to the entry point: a SIGTERM then ended it at
    once (status -15, no log line), a SIGINT with a traceback (-2). Its start is the entry
    point's now, before any of them, and the signal is held as kvtierd's is."""
    d = DaemonProcess(
        tmp_path,
        f"{daemon_factory._sockdir}/m.sock",
        ["--set=tiers.l1.capacity_bytes=64MiB"],
        entry=("-c", _MODULE_SIGNALLING_ITSELF, sig.name),
    )
    daemon_factory._daemons.append(d)
    d.start(wait=False)
    _assert_stopped_cleanly(d)
    assert f"{sig.name} arrived while starting" in d.log()
