"""The checkout's kernels/ folder, found as top-level ``kernels`` when the checkout's root is on
sys.path, stands aside for the Hub's distribution of that name (transformers imports it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]


def _run_in_checkout(code: str, *flags: str, pythonpath: Path | None = None) -> str:
    env = {"PATH": "/usr/bin:/bin"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=CHECKOUT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow  # a fresh interpreter imports transformers and torch: ~6 s
def test_transformers_imports_its_models_with_the_checkout_on_sys_path() -> None:
    # `python -c` puts the working directory first on sys.path, as `python -m pytest` does.
    assert (
        _run_in_checkout(
            "import sys; assert sys.path[0] == ''\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "import kernels, kvtier.kernels\n"
            "print(kernels is not kvtier.kernels and 'site-packages' in kernels.__file__)"
        )
        == "True"
    )


def test_the_package_found_after_the_checkout_takes_the_name(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("WHICH = 'the other one'\n")
    (tmp_path / "kernels" / "sub.py").write_text("VALUE = 7\n")
    assert (
        _run_in_checkout(
            "import kernels, kernels.sub; print(kernels.WHICH, kernels.sub.VALUE)",
            pythonpath=tmp_path,
        )
        == "the other one 7"
    )


def test_with_no_other_package_the_name_stays_this_empty_package() -> None:
    # -S: no site-packages, so nothing but the checkout's folder is called kernels. Older
    # transformers import it to read a version, and must find an importable package without one.
    assert (
        _run_in_checkout(
            "import importlib, os\n"
            "kernels = importlib.import_module('kernels')\n"
            "print(getattr(kernels, '__version__', 'N/A'),\n"
            "      os.path.samefile(os.path.dirname(kernels.__file__), 'kernels'))",
            "-S",
        )
        == "N/A True"
    )
