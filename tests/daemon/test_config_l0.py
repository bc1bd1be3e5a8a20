"""The GPU tier's config section: off by default, every key documented, bad values named."""

from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

from kvtier.daemon.config import L0Config, load_config
from kvtier.daemon.errors import ConfigError

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "kvtier.yaml")


def test_l0_is_off_by_default_and_every_key_is_in_the_reference_file():
    config = load_config()
    assert config.tiers.l0 == L0Config()
    assert not config.tiers.l0.enabled and config.tiers.l0.gds == "auto"
    with open(EXAMPLE) as f:
        documented = yaml.safe_load(f)["tiers"]["l0"]
    assert list(documented) == [f.name for f in dataclasses.fields(L0Config)]


def test_l0_overrides():
    c = load_config(
        overrides=[
            "tiers.l0.enabled=true",
            "tiers.l0.capacity_bytes=16GiB",
            "tiers.l0.streams=4",
            "tiers.l0.device=1",
            "tiers.l0.gds=false",
        ]
    )
    assert (c.tiers.l0.enabled, c.tiers.l0.capacity_bytes, c.tiers.l0.streams) == (
        True,
        16 << 30,
        4,
    )
    assert (c.tiers.l0.device, c.tiers.l0.gds) == (1, "false")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("tiers.l0.streams=0", "tiers.l0.streams"),
        ("tiers.l0.streams=17", "tiers.l0.streams"),
        ("tiers.l0.gds=maybe", "tiers.l0.gds"),
        ("tiers.l0.device=-1", "tiers.l0.device"),
        ("tiers.l0.enabled=yes please", "tiers.l0.enabled"),
        ("tiers.l0.capacity_bytes=1KiB", "tiers.l0.capacity_bytes"),
        ("tiers.l0.segment_bytes=1000", "tiers.l0.segment_bytes"),
        ("tiers.l0.low_watermark=0.99", "tiers.l0.low_watermark"),
    ],
)
def test_bad_l0_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_a_top_level_l0_section_points_to_its_place():
    with pytest.raises(ConfigError, match=r"now 'tiers\.l0'"):
        load_config(overrides=["l0.enabled=true"])
