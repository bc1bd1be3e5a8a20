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
    real ones when vLLM is installed), and ``identity(model)``: a test model's identity (two
    layers, 4-token blocks of 64 bytes a layer, float32)."""
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
    config = importlib.import_module("kvtier.client.integrations.vllm_config")

    def identity(model: str) -> object:
        return config.ModelIdentity(
            model=model,
            revision="",
            kv_dtype="float32",
            kv_layout="test",
            block_tokens=4,
            tp_size=1,
            pp_size=1,
            tenant="default",
            extra="",
            num_layers=2,
            layer_block_bytes=64,
        )

    yield SimpleNamespace(
        config=config,
        identity=identity,
        meta=importlib.import_module("kvtier.client.integrations.vllm_meta"),
        worker=importlib.import_module("kvtier.client.integrations.vllm_worker"),
        scheduler=importlib.import_module("kvtier.client.integrations.vllm_scheduler"),
    )
