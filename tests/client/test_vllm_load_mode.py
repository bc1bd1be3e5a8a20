"""How the vLLM connector loads by default (``vllm_config.resolve_load_mode``): layer by
layer with one worker, asynchronously with several, where a layer-wise load that fails on
one worker would let the others store KV computed over the failed blocks; no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.client.integrations.vllm_config import ConnectorConfig, resolve_load_mode


@pytest.mark.parametrize(
    "tp, pp, mode", [(1, 1, "layerwise"), (2, 1, "async"), (1, 2, "async"), (4, 2, "async")]
)
def test_auto_loads_layer_by_layer_only_with_one_worker(tp, pp, mode):
    config = ConnectorConfig.from_extra_config({})
    assert config.load_mode == "auto"
    resolved = resolve_load_mode(config, SimpleNamespace(tp_size=tp, pp_size=pp))
    assert resolved.load_mode == mode
    assert resolved.address == config.address and resolved.layer_groups == config.layer_groups


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_an_explicit_mode_stands_and_layerwise_with_several_workers_is_warned_of(mode, caplog):
    config = ConnectorConfig.from_extra_config({"load_mode": mode})
    with caplog.at_level("WARNING", logger="kvtier"):
        assert resolve_load_mode(config, SimpleNamespace(tp_size=2, pp_size=1)) is config
        assert resolve_load_mode(config, SimpleNamespace(tp_size=1, pp_size=1)) is config
    warned = "can make the others store blocks computed over it" in caplog.text
    assert warned == (mode == "layerwise")
    assert caplog.text.count("kvtier connector: load_mode") == (mode == "layerwise")


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="load_mode must be one of"):
        ConnectorConfig.from_extra_config({"load_mode": "eager"})
