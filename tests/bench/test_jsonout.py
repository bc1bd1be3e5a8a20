"""With ``--json``, stdout holds the JSON object and nothing else, whoever writes to it: a
child process, a write to file descriptor 1, C's stdio, the interpreter's own stdout object.
Before, the report and the figures shared stdout (`kvtier bench l1 --json | jq .` failed to
parse), and a child's output would have landed among them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from benchjson import bench_cli, only_json

from kvtier import bench
from kvtier.bench.jsonout import JsonStdout

WRITERS = textwrap.dedent(
    """
    import ctypes, os, subprocess, sys
    from kvtier.bench.jsonout import JsonStdout

    with JsonStdout() as out:
        print("the report")
        subprocess.run([sys.executable, "-c", "print('a child')"], check=True)
        os.write(1, b"a write to fd 1\\n")
        ctypes.CDLL(None).printf(b"C stdio, buffered\\n")
        sys.__stdout__.write("the interpreter's stdout, buffered\\n")
        out.emit({"figure": 1})
    print("after the run")
    """
)


def test_everything_but_the_object_goes_to_stderr_and_stdout_comes_back() -> None:
    # Buffered as a benchmark's stdout is (PYTHONUNBUFFERED would make C's stdout unbuffered).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    r = subprocess.run(
        [sys.executable, "-c", WRITERS], capture_output=True, text=True, timeout=60, env=env
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == '{"figure": 1}\nafter the run\n'
    for line in (
        "the report",
        "a child",
        "a write to fd 1",
        "C stdio, buffered",
        "the interpreter's stdout, buffered",
    ):
        assert line in r.stderr.splitlines(), line


def test_one_object_only(capsys: pytest.CaptureFixture[str]) -> None:
    with JsonStdout() as out:
        out.emit({"figure": 1})
        out.fail("too late: the figures were written")  # writes nothing
        with pytest.raises(RuntimeError, match="already written"):
            out.emit({"figure": 2})
    assert capsys.readouterr().out == '{"figure": 1}\n'


def test_a_benchmark_that_refuses_leaves_its_error_as_the_object(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    r = bench_cli("l2", "--dir", str(tmp_path / "file" / "bench"), timeout_s=120)
    assert r.returncode == 1
    error = only_json(r.stdout)
    assert error["ok"] is False
    assert error["error"].startswith("kvtier bench: cannot make a scratch folder in ")
    assert "Traceback" not in r.stderr


def test_a_benchmark_that_raises_leaves_its_error_as_the_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "kvtier_raising_bench.py").write_text(
        "def main(argv, emit):\n    raise RuntimeError('no figures')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(bench.BENCHMARKS, "raising", "kvtier_raising_bench")
    with pytest.raises(RuntimeError, match="no figures"):  # its traceback, as without --json
        bench.run_bench("raising", [], as_json=True)
    assert only_json(capfd.readouterr().out) == {
        "ok": False,
        "error": "kvtier bench raising: RuntimeError: no figures",
    }
