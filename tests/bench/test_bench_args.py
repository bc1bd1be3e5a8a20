"""Every benchmark refuses counts it cannot measure with, before it starts anything: ``bench
l3 --rounds 0`` ran no round and then failed its read-back check as "the tier read back
different bytes"; ``bench policy_memory --blocks -1`` ended in a numpy traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from benchjson import bench_cli, only_json

from kvtier.bench import run_bench


@pytest.mark.parametrize(
    ("what", "args", "message"),
    [
        ("l3", ["--rounds", "0"], "counts must be at least 1"),
        ("l3", ["--batch", "0"], "counts must be at least 1"),
        ("l3", ["--probes", "-1"], "counts must be at least 1"),
        ("policy_memory", ["--blocks", "0"], "--blocks must be at least 1"),
        ("policy_memory", ["--blocks", "-1"], "--blocks must be at least 1"),
        ("l2", ["--rounds", "0"], "every count must be at least 1"),
        ("l1", ["--rounds", "0"], "every count must be at least 1"),
        ("rpc", ["--ops", "0"], "counts must be at least 1"),
        ("instructions", ["--calls", "0"], "counts must be at least 1"),
        ("instructions", ["--idle-s", "0"], "counts must be at least 1"),
        ("restart", ["--rows", "0"], "counts must be at least 1"),
        ("flood", ["--calls", "0"], "--calls must be at least 1"),
        ("flood", ["--victim-keys", "4097"], "--victim-keys 1 to 4096"),
        ("flood", ["--request-bytes", "4kk"], "--request-bytes: not a size"),
        ("fair", ["--calls", "0"], "--calls must be at least 1"),
        ("fair", ["--batch-keys", "4097"], "--batch-keys 1 to 4096"),
    ],
)
def test_bad_counts_are_refused_with_a_message(
    what: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        run_bench(what, args, as_json=False)
    out = capsys.readouterr().err + str(e.value.code)
    assert e.value.code != 0
    assert message in out and "Traceback" not in out


@pytest.mark.parametrize(
    ("what", "missing", "extra"),
    [
        ("l3", "redis", "redis"),
        # ttft needs both: the `transformers` extra installs both (`kvtier[torch]`, named here
        # before, left it short of transformers).
        ("ttft", "torch", "transformers"),
        ("ttft", "transformers", "transformers"),
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_a_benchmark_whose_extra_is_not_installed_says_what_to_install(
    what: str, missing: str, extra: str, as_json: bool
) -> None:
    """Regression: in `make run`'s venv (runtime dependencies only) `kvtier bench l3`, even
    with --help, and `kvtier bench ttft` ended in a ModuleNotFoundError traceback. The
    package is hidden as if not installed (an import of it raises ModuleNotFoundError)."""
    code = (
        f"import sys; sys.modules[{missing!r}] = None; "
        "from kvtier.cli.main import main; sys.exit(main())"
    )
    args = ["bench", *(["--json"] if as_json else []), what]
    r = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )
    message = f"kvtier bench {what} needs {missing}, which this Python lacks"
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and f"pip install 'kvtier[{extra}]'" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    if as_json:
        error = only_json(r.stdout)  # the error object alone, for `| jq .`
        assert error["ok"] is False and message in error["error"]
    else:
        assert r.stdout == ""


@pytest.mark.parametrize("as_json", [False, True])
def test_bench_l3_without_redis_server_says_what_to_install(as_json: bool) -> None:
    """Regression: on a host without redis-server (as after `pip install 'kvtier[redis]'`,
    which the refusal above advises, in `make run`'s venv) `kvtier bench l3` ended in a
    RedisProcError traceback with exit status 1. The binaries are hidden as if not installed."""
    code = (
        "import sys; from kvtier.bench import redis_proc as rp; "
        "which, access = rp.shutil.which, rp.os.access; "
        "rp.shutil.which = lambda n, *a, **k: None if n.startswith('redis-') else which(n, *a, **k); "
        "rp.os.access = lambda p, *a, **k: '/redis-' not in str(p) and access(p, *a, **k); "
        "from kvtier.cli.main import main; sys.exit(main())"
    )
    args = ["bench", *(["--json"] if as_json else []), "l3"]
    r = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )
    message = "kvtier bench l3 starts its own Redis server: redis-server is not installed"
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "apt-get install redis-server" in r.stderr
    assert "--url" in r.stderr and "Traceback" not in r.stderr, r.stderr
    if as_json:
        error = only_json(r.stdout)
        assert error["ok"] is False and message in error["error"]
    else:
        assert r.stdout == ""


@pytest.mark.parametrize(
    ("what", "args", "code", "error", "why"),
    [
        # A benchmark's own refusal: its message is the error.
        ("l1", ["--rounds", "0"], 1, "kvtier bench l1: every count", "every count must be"),
        # argparse's: its message is on stderr only.
        ("policy_memory", ["--blocks", "0"], 2, "kvtier bench policy_memory: arguments refused",
         "--blocks must be at least 1"),
    ],
)  # fmt: skip
def test_refused_arguments_with_json_leave_one_error_object_on_stdout(
    what: str, args: list[str], code: int, error: str, why: str
) -> None:
    r = bench_cli(what, *args, timeout_s=120)
    assert r.returncode == code, r.stderr
    refused = only_json(r.stdout)
    assert refused["ok"] is False and refused["error"].startswith(error)
    assert why in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_bench_vllm_without_vllm_says_where_to_run_it_in_the_json_object_too() -> None:
    """Before, this refusal went to stderr only and `--json` left stdout empty."""
    code = (
        "import sys; sys.modules['vllm'] = None; from kvtier.cli.main import main; sys.exit(main())"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "bench", "vllm", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    error = only_json(r.stdout)
    assert error["ok"] is False and "kvtier bench vllm needs vLLM" in error["error"]
    assert ".venv-vllm/bin/kvtier bench vllm" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("what", "args", "message"),
    [
        ("l1", ["--copy-threads", "1000"], "--copy-threads must be at most 64"),
        ("l2", ["--block-bytes", "0"], "--block-bytes must be a positive multiple of 4096"),
        ("l2", ["--block-bytes", "-4096"], "--block-bytes must be a positive multiple of 4096"),
        ("ttft", ["--block-tokens", "0"], "--block-tokens must be at least 1"),
        ("l3", ["--url", "memcached://x"], "--url memcached://x: L3: URL 'memcached://x'"),
        ("l3", ["--url", "redis://127.0.0.1:1", "--rounds", "1"], "--url redis://127.0.0.1:1: "),
    ],
)
def test_regression_arguments_that_ended_in_a_traceback_are_refused_with_a_message(
    what: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by hostile51: `bench l1 --copy-threads 1000` (the daemon refused to start: a
    RuntimeError), `bench l2 --block-bytes 0` and `bench ttft --block-tokens 0`
    (ZeroDivisionError), `bench l3 --url` of another scheme or a server that does not answer
    (TierUnavailable, redis' ConnectionError) each ended in a traceback."""
    with pytest.raises(SystemExit) as e:
        run_bench(what, args, as_json=False)
    out = capsys.readouterr().err + str(e.value.code)
    assert e.value.code != 0
    assert message in out and "Traceback" not in out


@pytest.mark.parametrize(
    ("what", "flag"),
    [("l2", "--dir"), ("restart", "--dir"), ("l3", "--dir"), ("ttft", "--l2-dir")],
)
def test_regression_a_scratch_folder_under_a_file_is_refused_with_a_message(
    what: str, flag: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench l2 --dir FILE` (and the others' scratch folders) ended in a FileExistsError or
    NotADirectoryError traceback."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(SystemExit) as e:
        run_bench(what, [flag, str(a_file / "deeper")], as_json=False)
    assert e.value.code == f"kvtier bench: cannot make a scratch folder in {a_file}/deeper: " + (
        "Not a directory"
    )
