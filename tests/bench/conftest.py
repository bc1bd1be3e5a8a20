"""The benchmark tests run each benchmark in process at a tiny size."""

from __future__ import annotations

import pytest
from benchjson import RunJson, make_run_json


@pytest.fixture
def run_json(capsys: pytest.CaptureFixture[str]) -> RunJson:
    """``run_json(NAME, *args)``: run ``kvtier bench NAME *args --json``, return its JSON."""
    return make_run_json(capsys)
