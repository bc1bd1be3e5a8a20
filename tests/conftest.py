"""Shared fixtures: real daemons (see harness.py) and shared-memory pools."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import DaemonFactory, DaemonProcess

# Real redis-server fixtures for the L3 tier's tests.
pytest_plugins = ("redis_servers",)


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[DaemonFactory]:
    factory = DaemonFactory(tmp_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for a whole module, for tests that leave no state behind."""
    factory = DaemonFactory(tmp_path_factory.mktemp("shared-daemon"))
    yield factory()
    factory.close()


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    """A daemon with a 128 MiB L1 and otherwise default config."""
    return daemon_factory()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            # The marker, not `"gpu" in item.keywords`: keywords also hold the names of the
            # folders above a test, so a checkout in a folder named gpu skipped everything.
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)
