"""Shared fixtures: real daemons (see harness.py) and shared-memory pools."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The tests fork (peers.run_as) in a process that holds gRPC channels. With gRPC's fork
# support, on by default, its handlers ran around each fork: a child aborted in them now and
# then ("Check failed: next_worker->state == KICKED": 1 run in 5-13 of
# test_peer_credentials.py) and once a fork waited in them for good. The children make plain
# system calls only, so the handlers buy nothing here. Set before grpc is first imported
# (harness imports the client).
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

from forkserver import close_fork_server
from harness import DaemonFactory, DaemonProcess, NamespacedDaemon

# Real redis-server fixtures for the L3 tier's tests.
pytest_plugins = ("redis_servers",)


def pytest_sessionfinish(session: pytest.Session) -> None:
    close_fork_server()  # the daemons' (harness.py), where this process started one


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[DaemonFactory]:
    factory = DaemonFactory(tmp_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for a whole module, for tests that leave no state behind."""
    factory = DaemonFactory(tmp_path_factory.mktemp("shared-daemon"))
    try:
        yield factory()
    finally:  # also when the daemon did not start: the factory removes what it made
        factory.close()


@pytest.fixture
def namespaced_daemon(shared_daemon: DaemonProcess) -> NamespacedDaemon:
    """The module's shared daemon through a namespace of this test's own (see
    ``NamespacedDaemon``): for tests that need no daemon of their own, only keys no other
    test stored, and no pool but their own."""
    return NamespacedDaemon.fresh(shared_daemon)


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    """A daemon with a 128 MiB L1 and otherwise default config."""
    return daemon_factory()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB ext4 filesystem of 4 KiB blocks, as a data disk's (mkfs.ext4 would make
    1 KiB ones this small: SQLite's shared memory then has holes, a SIGBUS where a full disk
    cannot fill them), loop-mounted, for tests that fill a disk. Skips when the sandbox
    cannot mount one (needs root, loop devices and mkfs.ext4)."""
    if os.geteuid() != 0:
        pytest.skip("loop-mounting a small filesystem needs root")
    if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        pytest.skip("mkfs.ext4 or mount is not installed")
    image = tmp_path / "small.img"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(48 << 20)
    made = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(image)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    mounted = subprocess.run(
        ["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount a filesystem here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Async tests run on the daemon's default event loop (``server.event_loop: uvloop``):
    uvloop differs where it matters (its transports hold unsent bytes by reference, where
    asyncio's copy them: see tiers/remote/wire.py). Tests that call ``asyncio.run`` keep the
    standard library's loop, the other choice."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


_NO_CUDA: list[str] = []
_HAS_CUDA: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA. Without it they are deselected, not skipped (they
    cannot run on this machine, which is not a reason to report them as skipped work), and
    the summary says how many; on a machine with CUDA the same ``make test`` runs them, and
    deselects instead the tests marked ``no_cuda`` (what a host without CUDA does)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        # Tests of what a host without CUDA does cannot run here; the same bookkeeping.
        cpu = [item for item in items if item.get_closest_marker("no_cuda") is not None]
        if cpu:
            config.hook.pytest_deselected(items=cpu)
            items[:] = [item for item in items if item.get_closest_marker("no_cuda") is None]
            _HAS_CUDA.extend(item.nodeid for item in cpu)
        return
    # The marker, not `"gpu" in item.keywords`: keywords also hold the names of the folders
    # above a test, so a checkout in a folder named gpu would lose everything.
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
        _NO_CUDA.extend(item.nodeid for item in gpu)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _HAS_CUDA:
        terminalreporter.write_line(
            f"{len(_HAS_CUDA)} tests of a host without CUDA deselected: this one has CUDA"
        )
    if _NO_CUDA:
        terminalreporter.write_line(
            f"{len(_NO_CUDA)} GPU tests deselected: no CUDA device here (they run where "
            "torch.cuda.is_available(); `kvtier bench gpu` checks the data plane on a GPU)"
        )
