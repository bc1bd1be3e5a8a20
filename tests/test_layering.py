"""Which package may import which (DESIGN.md §8), checked on the real import graph: each side
is imported in a fresh interpreter and the modules it pulled in are listed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import importlib, json, pkgutil, sys
import kvtier
for top in {tops!r}:
    pkg = importlib.import_module(top)
    importlib.import_module(top)
    for info in pkgutil.walk_packages(pkg.__path__, top + "."):
        if not info.name.endswith("__main__") and not any(
            info.name.startswith(s) for s in {skip!r}
        ):
            importlib.import_module(info.name)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("kvtier."))))
"""


def _imported(tops: list[str], skip: tuple[str, ...] = ()) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(tops=tops, skip=skip)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter per package set, ~14 s: `make test-slow`
@pytest.mark.parametrize(
    "tops, forbidden",
    [
        (["kvtier.daemon", "kvtier.tiers"], ("kvtier.client", "kvtier.bench", "kvtier.cli")),
        (["kvtier.tiers"], ("kvtier.daemon",)),
        (["kvtier.client"], ("kvtier.daemon", "kvtier.tiers", "kvtier.bench")),
    ],
)
def test_packages_import_only_what_the_design_allows(tops, forbidden):
    # The transformers integration needs transformers; it obeys the same rule, so it is
    # checked too (it is installed in the test environment). The vLLM connector needs vLLM
    # and the SGLang backend SGLang, which live in their own environments (`make test-vllm`,
    # `make test-sglang`, which check the backend the same way): they are left out here.
    loaded = _imported(
        tops, skip=("kvtier.client.integrations.vllm", "kvtier.client.integrations.sglang")
    )
    assert [m for m in loaded if m.startswith(forbidden)] == []


def test_no_policy_module_imports_the_registry():
    """The registry names the built-in policies and imports them when asked: were a policy
    module to import the registry back, the two would form an import cycle."""
    import ast
    from pathlib import Path

    import kvtier.daemon.policy as policy

    cycles = []
    for path in Path(policy.__path__[0]).glob("*.py"):
        if path.name == "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith("kvtier.daemon.policy.registry") for n in names):
                cycles.append(path.name)
    assert cycles == []
