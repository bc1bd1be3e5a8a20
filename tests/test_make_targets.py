"""The Makefile's test targets that spread their tests over pytest-xdist worker processes:
what their runs do when a worker's process dies."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _xdist_options(target: str) -> list[str]:
    """The pytest-xdist options of ``make TARGET``'s pytest command (``make -n``: printed,
    nothing run), as the Makefile sets them: not those of a make running this test (its
    variables reach a make it starts), nor TEST_WORKERS=0 and the like set in the
    environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and "WORKERS" not in k}
    printed = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True, check=True, env=env
    ).stdout
    args = shlex.split(next(x for x in printed.splitlines() if " -m pytest " in x))
    return [
        part
        for i, arg in enumerate(args)
        if arg in ("-n", "--dist", "--max-worker-restart")
        for part in args[i : i + 2]
    ]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["test", "test-slow", "test-l3-cluster", "test-vllm"])
def test_regression_a_worker_that_died_hung_the_target_instead_of_failing_it(tmp_path, target):
    """A worker whose process died in a test (a segfault, the OOM killer) was replaced, and
    under ``--dist loadfile`` pytest-xdist (3.8) then never ended the run: `make test`,
    test-slow and test-vllm hung rather than failed. With the target's options, a file whose
    test ends its process, among more files than there are workers (with fewer, the run
    ended): the run ends, failed, naming that test (the files no worker had begun are left),
    no worker replaced. Replaced, the run hung, or, in some runs, ended once the replacements
    had run out (12 for 3 workers: each re-ran the test that died) or in an INTERNALERROR."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_dies.py").write_text("import os\n\n\ndef test_dies():\n    os._exit(3)\n")
    for i in range(6):
        (tmp_path / f"test_passes_{i}.py").write_text("def test_passes():\n    pass\n")
    options = _xdist_options(target)
    assert "-n" in options, options
    # Not the environment's PYTEST_ADDOPTS: with -q there, xdist prints none of its worker
    # lines (that it replaced one, or that restarting is disabled) and the last assert is blind.
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *options, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its workers too are ended below if it never ends
    )
    try:
        out, _ = run.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
        pytest.fail(f"make {target}'s pytest ({shlex.join(options)}) never ended")
    assert run.returncode == 1, out
    assert "crashed while running 'test_dies.py::test_dies'" in out, out
    assert "replacing crashed worker" not in out, out
