"""The README's Python snippets, saved to a file as it says and run as they are, from another
directory, against a real daemon (found through ``KVTIER_ADDRESS``, as any client finds one):
a snippet that uses a name it never defines, or prints other than its comments say, fails
here. The one for CUDA pools needs a GPU and its engine's tensors, and is not run. The
README's YAML config examples are loaded as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.daemon.config import ids_from, load_config

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)
CONFIG_EXAMPLES = re.findall(r"```yaml\n(.*?)```", README, re.S)


def _snippet(marker: str) -> str:
    found = [s for s in SNIPPETS if marker in s]
    assert len(found) == 1, (marker, len(found))
    return found[0]


def _run(code: str, directory: Path, address: str) -> str:
    path = directory / "snippet.py"
    path.write_text(code)
    env = {**os.environ, "KVTIER_ADDRESS": address}
    r = subprocess.run(
        [sys.executable, path.name],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_every_python_snippet_is_run_here_but_the_cuda_one():
    """A new snippet gets a test of its own here (or is named as not runnable)."""
    assert len(SNIPPETS) == 3
    assert "CudaPool.from_tensors" in _snippet("CudaPool")


def test_the_quick_start_snippet_stores_and_loads_what_its_comments_say(daemon_factory, tmp_path):
    d = daemon_factory(l1_bytes="256MiB")
    out = _run(_snippet("SharedMemoryPool.for_layout"), tmp_path, d.address).splitlines()
    assert out[:2] == ["992", "992"]  # tokens held, tokens loaded
    assert re.fullmatch(
        r"\[TierStats\(tier=<Tier.L1_HOST: 2>, capacity_bytes=268435456, used_bytes=\d+, "
        r"blocks=62, state='ok'\)\]",
        out[2],
    ), out[2]


@pytest.mark.slow  # two interpreters importing torch and transformers: `make test-slow`
def test_the_transformers_snippet_runs_and_reuses_its_prefix_the_second_time(
    daemon_factory, tmp_path
):
    """Regression: the snippet used `model` and `input_ids` without defining them."""
    d = daemon_factory()
    code = _snippet("KVTierPrefixCache(model")
    assert _run(code, tmp_path, d.address) == "0 32\n"
    assert _run(code, tmp_path, d.address) == "256 32\n"


def test_regression_the_readme_config_examples_load_as_written(tmp_path):
    """Regression: the Tenants example gave alice an L2 quota with L2 off (the default), so
    saved as a config file it was refused (exit 2, `tenants[0].quotas.l2: tiers.l2 is not
    enabled`). Each example is loaded as written; the users and groups it names get ids here,
    and the files it names are read at start, not at load."""
    names = {("user", "alice"): 1001, ("group", "inference"): 1002}
    loaded = []
    for i, example in enumerate(CONFIG_EXAMPLES):
        path = tmp_path / f"example{i}.yaml"
        path.write_text(example)
        with ids_from(dict(names)):
            loaded.append(load_config(path))
    l3, tenants = loaded  # the cluster tier's example, then the tenants'
    assert l3.tiers.l3.enabled and l3.tiers.l3.mode == "cluster"
    assert [t.name for t in tenants.tenants] == ["alice", "bob", "ops"]
    assert tenants.tenants[0].quotas.l2 == 100 << 30
