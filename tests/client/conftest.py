"""Fixtures of the client tests that drive the vLLM connector's sides without vLLM."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace

import pytest


@pytest.fixture
def vllm_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """The connector's worker, scheduler and metadata modules, with vLLM's base classes (the
    real ones when vLLM is installed)."""
    try:
        importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    except ImportError:
        base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
        base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})  # type: ignore[attr-defined]
        base.KVConnectorWorkerMetadata = type("KVConnectorWorkerMetadata", (), {})  # type: ignore[attr-defined]
        parts = base.__name__.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(parts[i - 1]))
        monkeypatch.setitem(sys.modules, base.__name__, base)
        for name in ("vllm_meta", "vllm_worker", "vllm_scheduler"):
            monkeypatch.delitem(sys.modules, f"kvtier.client.integrations.{name}", raising=False)
    yield SimpleNamespace(
        config=importlib.import_module("kvtier.client.integrations.vllm_config"),
        meta=importlib.import_module("kvtier.client.integrations.vllm_meta"),
        worker=importlib.import_module("kvtier.client.integrations.vllm_worker"),
        scheduler=importlib.import_module("kvtier.client.integrations.vllm_scheduler"),
    )
