"""``kvtier replay``: output, JSON, the README's commands on the shipped trace, and errors
that name the problem without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.sim import tracegen
from kvtier.sim.report import format_sweep, plot_run, plot_sweep, sweep
from kvtier.sim.trace import trace_from_requests, write_jsonl

REPO = Path(__file__).resolve().parents[2]
SHIPPED = "sim/traces/chat.jsonl"


def requests(*chains: list[int]) -> list[dict[str, object]]:
    return [{"timestamp": 1000 * i, "hash_ids": ids} for i, ids in enumerate(chains)]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_json_is_all_of_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --json stdout is the JSON object alone (a script pipes it into a parser); the
    text report goes to stderr. It printed the report first, so ``json.loads`` of stdout
    failed."""
    path = tmp_path / "t.jsonl"
    write_jsonl(path, requests([1, 2], [1, 2, 3], [4], [1, 2, 3]))
    rc = main(["replay", str(path), "--policy", "lru", "--l1-blocks", "3", "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    doc = json.loads(captured.out)
    assert {
        "policy",
        "semantics",
        "l1_blocks",
        "l2_blocks",
        "accesses",
        "hits",
        "hit_ratio",
        "prefix_hit_ratio",
        "tier_hits",
        "accesses_per_s",
        "promotions",
        "prefetches",
        "demotions",
        "l2_writes",
        "hinted",
    } <= set(doc)
    assert (doc["policy"], doc["l1_blocks"], doc["l2_blocks"]) == ("lru", 3, 0)
    assert (doc["accesses"], doc["hits"]) == (9, 4)
    assert doc["tier_hits"] == {"l1": 4}
    assert "block accesses/s" in captured.err and "4 requests" in captured.err
    # Without --json the report is stdout's, and stderr stays empty.
    assert main(["replay", str(path), "--policy", "lru", "--l1-blocks", "3"]) == 0
    captured = capsys.readouterr()
    assert "block accesses/s" in captured.out and captured.err == ""


def test_sweep_json_is_all_of_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(path, tracegen.scenario("chat", seed=1, duration_s=20.0))
    args = ["replay", str(path), "--sweep", "--policies", "lru", "--percents", "5,20"]
    assert main([*args, "--nodes", "2", "--l3-blocks", "100", "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["policy"] for r in json.loads(captured.out)["sweep"]] == ["lru", "lru"]
    assert "cluster: 2 nodes" in captured.err and "\nlru " in captured.err


def test_the_stack_options_reach_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [*requests([1], [2]), {"timestamp": 5000, "hash_ids": [1]}])
    common = ["replay", str(path), "--policy", "lru", "--l1-blocks", "1", "--json"]
    assert main([*common, "--queue-window", "10"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["hits"] == 1 and doc["hinted"] == 3
    assert main([*common, "--protect-s", "100"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["declined"] == {"l1:protected": 1} and doc["hits"] == 1
    assert main([*common, "--l2-blocks", "4", "--write-policy", "write_through"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["l2_writes"] == 2 and doc["tier_hits"] == {"l1": 0, "l2": 1}


def test_cluster_options_reach_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Three turns of a conversation on three nodes: L3 serves turn 2 two blocks and turn 3
    # three (tests/sim/test_cluster.py works it out).
    path = tmp_path / "t.jsonl"
    write_jsonl(path, requests([1, 2], [1, 2, 3], [1, 2, 3, 4]))
    args = ["replay", str(path), "--policy", "lru", "--l1-blocks", "10", "--nodes", "3"]
    args += ["--route", "round-robin", "--l3-blocks", "10", "--l3-admission", "always"]
    assert main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    out = captured.err.strip().splitlines()
    cluster = "  cluster: 3 nodes, route round-robin; shared L3 10 blocks (ttl 3600 s, admission"
    assert f"{cluster} always)" in out
    assert "  hits by tier: l1 0, l3 5; misses 4; promotions 5" in out
    assert any(line.startswith("  node 2: 1 requests, 4 accesses") for line in out)
    doc = json.loads(captured.out)
    assert (doc["nodes"], doc["route"], doc["l3_blocks"]) == (3, "round-robin", 10)
    assert (doc["l3_ttl_s"], doc["l3_admission"]) == (3600.0, "always")
    assert doc["tier_hits"] == {"l1": 0, "l3": 5} and doc["misses"] == 4
    assert doc["l3"] == {"writes": 4, "reads": 5, "evictions": 0, "expiries": 0, "held": 4}
    assert [n["l3_writes"] for n in doc["per_node"]] == [2, 1, 1]
    assert [n["tier_hits"] for n in doc["per_node"]][2] == {"l1": 0, "l3": 3}
    # The daemon's defaults: second_hit writes nothing a node saw once.
    assert main([*args[:-2], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["l3_admission"], doc["tier_hits"]["l3"]) == ("second_hit", 0)
    # One node without L3: no cluster to describe.
    assert main(["replay", str(path), "--policy", "lru", "--l1-blocks", "10"]) == 0
    out = capsys.readouterr().out
    assert "  cluster:" not in out and "  node 0:" not in out


def test_sweep_with_a_cluster_sweeps_each_nodes_l1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(path, tracegen.scenario("chat", seed=1, duration_s=60.0))
    args = ["replay", str(path), "--sweep", "--policies", "lru", "--percents", "5,20"]
    assert main([*args, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)["sweep"]
    assert main([*args, "--nodes", "2", "--l3-blocks", "100", "--json"]) == 0
    captured = capsys.readouterr()
    out = captured.err.strip().splitlines()
    assert (
        out[1]
        == "cluster: 2 nodes, route prefix; shared L3 100 blocks (ttl 3600 s, admission second_hit)"
    )
    assert out[2].startswith("policy") and out[3].startswith("lru")
    runs = json.loads(captured.out)["sweep"]
    assert [r["l1_blocks"] for r in runs] == [r["l1_blocks"] for r in alone]
    assert all(r["nodes"] == 2 and len(r["per_node"]) == 2 for r in runs)


def test_semantics_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(
        path,
        [
            {"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]},
            {"timestamp": 1000, "input_length": 600, "hash_ids": [1, 3]},
        ],
    )
    for semantics, accesses in (("full", 2), ("all", 4)):
        args = ["replay", str(path), "--l1-blocks", "4", "--json", "--semantics", semantics]
        assert main(args) == 0
        doc = json.loads(capsys.readouterr().out)
        assert (doc["semantics"], doc["accesses"], doc["hits"]) == (semantics, accesses, 1)


@pytest.mark.slow  # every replay command of the README, ~5-8 s: `make test-slow`
def test_readme_commands_run_on_the_shipped_trace(tmp_path: Path) -> None:
    """The README's replay commands, verbatim from the repository root."""
    sweep_run = run("replay", SHIPPED, "--sweep", "--policies", "density,lru,opt")
    assert sweep_run.returncode == 0, sweep_run.stderr
    lines = sweep_run.stdout.splitlines()
    assert lines[1].startswith("policy") and "1% (" in lines[1]
    assert [line.split()[0] for line in lines[2:5]] == ["density", "lru", "opt"]
    one = run(
        "replay",
        SHIPPED,
        "--policy",
        "density",
        "--l1-blocks",
        "200",
        "--l2-blocks",
        "800",
        "--queue-window",
        "30",
        "--json",
    )
    assert one.returncode == 0, one.stderr
    doc = json.loads(one.stdout)
    assert doc["policy"] == "density" and doc["hits"] > 0 and doc["hinted"] > 0
    cluster = run(
        "replay",
        SHIPPED,
        "--l1-blocks",
        "241",
        "--nodes",
        "4",
        "--route",
        "round-robin",
        "--l3-blocks",
        "2415",
        "--l3-admission",
        "always",
        "--json",
    )
    assert cluster.returncode == 0, cluster.stderr
    doc = json.loads(cluster.stdout)
    assert round(100 * doc["hit_ratio"], 2) == 32.09  # README's cluster table
    assert len(doc["per_node"]) == 4 and doc["tier_hits"]["l3"] > 0


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, ["--l1-blocks", "4"], "no such file"),
        ('{"timestamp": 0, "hash_ids": [1]}\nnot json\n', ["--l1-blocks", "4"], ":2: not valid"),
        ('{"timestamp": 0, "hash_ids": [1, "a"]}\n', ["--l1-blocks", "4"], ":1: 'hash_ids'"),
        ('{"hash_ids": [1]}\n', ["--l1-blocks", "4"], ":1: 'timestamp'"),
        ('{"timestamp": 0, "hash_ids": [1]}\n', [], "--l1-blocks is required"),
        ('{"timestamp": 0, "hash_ids": [1]}\n', ["--l1-blocks", "4", "--admission", "x"], "x"),
        (
            '{"timestamp": 0, "input_length": 9000, "hash_ids": [1]}\n',
            ["--l1-blocks", "4"],
            "--block-tokens",
        ),
        ("", ["--l1-blocks", "4"], "the trace holds no requests"),
        (
            '{"timestamp": 0, "hash_ids": [1]}\n',
            ["--l1-blocks", "4", "--plot", "/nonexistent-kvtier-dir/x.png"],
            "is not a folder this user can write",
        ),
        ("\n\n", ["--sweep"], "the trace holds no requests"),
        (
            '{"timestamp": 0, "input_length": 100, "hash_ids": [1]}\n',
            ["--sweep"],
            "no request holds a full block of 512 tokens",
        ),
        (
            '{"timestamp": 0, "input_length": 100, "hash_ids": [1]}\n',
            ["--l1-blocks", "4"],
            "nothing is cacheable under --semantics full",
        ),
        # No ids at all: not a block size question (it said "no request holds a full block
        # of 512 tokens ... is --block-tokens right?", under --semantics all too).
        (
            '{"timestamp": 0, "input_length": 0, "hash_ids": []}\n{"timestamp": 1, "hash_ids": []}\n',
            ["--l1-blocks", "4", "--semantics", "all"],
            "t.jsonl: no request has any hash_ids, so there is nothing to replay",
        ),
        (
            '{"timestamp": 0, "hash_ids": [1]}\n',
            ["--l1-blocks", "4", "--nodes", "2", "--l3-ttl-s", "60"],
            "--l3-ttl-s needs an L3: give --l3-blocks",
        ),
        (
            '{"timestamp": 0, "hash_ids": [1]}\n',
            ["--l1-blocks", "4", "--l3-admission", "always"],
            "--l3-admission needs an L3",
        ),
    ],
)
def test_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    args: list[str],
    message: str,
) -> None:
    path = tmp_path / "t.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["replay", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--l1-blocks", "10"], "--l1-blocks"),
        (["--l2-blocks", "100"], "--l2-blocks"),
        (["--admission", "second_hit"], "--admission"),
        (["--l2-admission", "second_hit"], "--l2-admission"),
        (["--policy", "lru"], "--policy"),
    ],
)
def test_sweep_refuses_the_options_it_does_not_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], flag: str
) -> None:
    """--sweep replays one tier for --policies: these options were ignored without a word,
    and `--sweep --l2-blocks 100` printed one tier's figures as if they were two tiers'."""
    path = tmp_path / "t.jsonl"
    write_jsonl(path, requests([1, 2], [1, 2, 3]))
    assert main(["replay", str(path), "--sweep", *args]) == 2
    captured = capsys.readouterr()
    assert f"kvtier replay: error: {flag} does not apply to --sweep" in captured.err
    assert captured.out == ""


@pytest.mark.parametrize(
    ("args", "flag"), [(["--policies", "lru"], "--policies"), (["--percents", "5"], "--percents")]
)
def test_the_sweep_options_need_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], flag: str
) -> None:
    """Without --sweep they were ignored: one heat replay, not the policies asked for."""
    path = tmp_path / "t.jsonl"
    write_jsonl(path, requests([1, 2], [1, 2, 3]))
    assert main(["replay", str(path), "--l1-blocks", "2", *args]) == 2
    assert f"kvtier replay: error: {flag} needs --sweep" in capsys.readouterr().err


@pytest.mark.parametrize("rule", ["zzz", "second_hit"])
def test_regression_an_l2_admission_without_an_l2_was_ignored_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rule: str
) -> None:
    """`replay --l1-blocks 2 --l2-admission zzz` replayed L1 alone and exited 0: the rule,
    misspelt or not, was never read without --l2-blocks (--l3-ttl-s and --l3-admission say
    they need an L3)."""
    path = tmp_path / "t.jsonl"
    write_jsonl(path, requests([1, 2], [1, 2, 3]))
    assert main(["replay", str(path), "--l1-blocks", "2", "--l2-admission", rule]) == 2
    captured = capsys.readouterr()
    assert "kvtier replay: error: --l2-admission needs an L2: give --l2-blocks" in captured.err
    assert captured.out == ""
    args = ["--l1-blocks", "2", "--l2-blocks", "4", "--l2-admission", "zzz"]
    assert main(["replay", str(path), *args]) == 2
    assert "unknown admission 'zzz'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--l1-blocks", "2", "--policy", "lru"],
        ["--l1-blocks", "2", "--policy", "density"],
        ["--sweep", "--policies", "lru,arc", "--percents", "50"],
    ],
)
def test_regression_a_half_life_no_replayed_policy_has_was_ignored_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """`replay --policy lru --half-life 10` (or density, or arc) replayed as without it and
    exited 0: only heat reads a half-life, and every other policy dropped it unread."""
    path = tmp_path / "t.jsonl"
    write_jsonl(path, requests([1, 2], [1, 2, 3]))
    assert main(["replay", str(path), *args, "--half-life", "10"]) == 2
    captured = capsys.readouterr()
    assert "kvtier replay: error: --half-life is the heat policy's" in captured.err
    assert captured.out == ""
    # With heat replayed, alone or in a sweep, it applies.
    assert main(["replay", str(path), "--l1-blocks", "2", "--half-life", "10"]) == 0
    assert main(["replay", str(path), "--sweep", "--percents", "50", "--half-life", "10"]) == 0


def test_regression_a_history_factor_without_forget_dropped_was_ignored_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`replay --history-factor 0` (the README's row is `--forget-dropped --history-factor 0`)
    replayed as without it and exited 0: policies forget nothing without --forget-dropped, so
    the factor was never read."""
    path = tmp_path / "t.jsonl"
    write_jsonl(path, requests([1, 2], [1, 2, 3]))
    assert main(["replay", str(path), "--l1-blocks", "2", "--history-factor", "0"]) == 2
    captured = capsys.readouterr()
    assert "kvtier replay: error: --history-factor needs --forget-dropped" in captured.err
    assert captured.out == ""
    args = ["--l1-blocks", "2", "--forget-dropped", "--history-factor", "0"]
    assert main(["replay", str(path), *args]) == 0
    # Left out, the factor is the daemon's (2).
    assert main(["replay", str(path), "--l1-blocks", "2", "--forget-dropped"]) == 0


@pytest.mark.parametrize(
    "args", [["--l1-blocks", "2"], ["--sweep", "--percents", "50"]], ids=["no-l2", "sweep"]
)
def test_regression_a_write_policy_without_an_l2_was_ignored_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """`replay --l1-blocks 2 --write-policy write_through` (or a sweep, one tier) replayed as
    without it and exited 0: a write policy says how blocks reach L2, and there was none."""
    path = tmp_path / "t.jsonl"
    write_jsonl(path, requests([1, 2], [1, 2, 3]))
    assert main(["replay", str(path), *args, "--write-policy", "write_through"]) == 2
    captured = capsys.readouterr()
    needs = "needs an L2: give --l2-blocks" if "--sweep" not in args else "does not apply to"
    assert f"kvtier replay: error: --write-policy {needs}" in captured.err
    assert captured.out == ""


@pytest.mark.parametrize("route", [[], ["--route", "round-robin"]])
def test_regression_a_route_seed_of_another_route_than_random_was_ignored_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], route: list[str]
) -> None:
    """`replay --nodes 2 --route-seed 5` (route prefix, the default) replayed as without the
    seed and exited 0: only --route random draws, so another seed changed nothing."""
    path = tmp_path / "t.jsonl"
    write_jsonl(path, requests([1, 2], [1, 2, 3]))
    args = ["--l1-blocks", "2", "--nodes", "2", *route, "--route-seed", "5"]
    assert main(["replay", str(path), *args]) == 2
    captured = capsys.readouterr()
    assert "kvtier replay: error: --route-seed needs --route random" in captured.err
    assert captured.out == ""
    args = ["--l1-blocks", "2", "--nodes", "2", "--route", "random", "--route-seed", "5"]
    assert main(["replay", str(path), *args]) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--l1-blocks", "-1"],
        ["--l1-blocks", "2", "--l2-blocks", "-1"],
        ["--l1-blocks", "2", "--protect-s", "-1"],
        ["--l1-blocks", "2", "--queue-window", "nan"],
        ["--l1-blocks", "2", "--l1-watermarks", "0.5,0.9"],
        ["--l1-blocks", "2", "--write-policy", "sometimes"],
        ["--sweep", "--policies", "lru,nope"],
        ["--sweep", "--percents", "0"],
        ["--l1-blocks", "2", "--nodes", "0"],
        # Far past any cluster: it ran without end (building and routing every node), and
        # past a C long it ended in an OverflowError traceback.
        ["--l1-blocks", "2", "--nodes", "1000000000"],
        ["--l1-blocks", "2", "--nodes", "1" + "0" * 30],
        ["--l1-blocks", "2", "--route", "nearest"],
        ["--l1-blocks", "2", "--route-seed", "-1"],
        ["--l1-blocks", "2", "--l3-blocks", "-1"],
        ["--l1-blocks", "2", "--l3-blocks", "9", "--l3-ttl-s", "-5"],
        ["--l1-blocks", "2", "--l3-blocks", "9", "--l3-admission", "belady"],
    ],
)
def test_bad_options_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["replay", str(tmp_path / "t.jsonl"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"argument {args[-2]}:" in err


@pytest.mark.parametrize(
    ("name", "message"),
    [
        # A folder: the figure went, silently, to a hidden file "<folder>/.png".
        ("figures/", "is a folder; name the image file"),
        # A format matplotlib does not write: refused after the replay (minutes on a large
        # trace), in matplotlib's words, without naming --plot.
        ("figures/run.xyz", "matplotlib cannot write .xyz files"),
    ],
)
def test_a_plot_it_cannot_save_is_refused_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, message: str
) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(path, requests([1, 2], [1, 2, 3]))
    (tmp_path / "figures").mkdir()
    plot = str(tmp_path / name)
    assert main(["replay", str(path), "--l1-blocks", "2", "--plot", plot]) == 2
    captured = capsys.readouterr()
    assert f"kvtier replay: error: --plot {plot}: {message}" in captured.err
    assert captured.out == ""  # nothing replayed
    assert list((tmp_path / "figures").iterdir()) == []


def test_an_output_error_is_not_called_a_plot_error(tmp_path: Path) -> None:
    """Only a failed save of the figure is a --plot error; stdout on a full device is
    Python's own error, not "--plot None: No space left on device"."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1]}\n')
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "replay", str(path), "--l1-blocks", "2"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1
    assert "--plot" not in proc.stderr and "Traceback" not in proc.stderr
    assert "kvtier replay: error: [Errno 28] No space left on device" in proc.stderr


def test_exit_code_and_no_traceback_as_a_process(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1, "hash_ids": 3}\n')
    proc = run("replay", str(path), "--l1-blocks", "2")
    assert proc.returncode == 2
    assert ":2:" in proc.stderr and "Traceback" not in proc.stderr


def test_trace_gen_into_a_pipe_its_reader_closes_ends_quietly() -> None:
    """Regression: ``kvtier trace gen -o - | head`` ended with ``error: [Errno 32] Broken
    pipe`` on stderr and exit status 2; like the other commands, it now ends quietly."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "trace", "gen", "--scenario", "chat", "-o", "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert json.loads(proc.stdout.readline())  # one request, then the reader goes away
    proc.stdout.close()
    assert proc.wait(120) == 0
    assert proc.stderr.read() == b""


def test_sweep_table_and_plot(tmp_path: Path) -> None:
    trace = trace_from_requests(tracegen.scenario("chat", seed=1, duration_s=120.0))
    results = sweep(trace, policies=("heat", "lru"), percents=(5, 20))
    table = format_sweep(results, trace.unique_blocks, (5, 20))
    rows = table.splitlines()
    assert rows[0].split()[1:3] == ["5%", f"({results[0].l1_blocks})"]
    assert rows[1].startswith("heat") and rows[2].startswith("lru")
    assert "speed" in rows[-1] and "heat" in rows[-1]
    import matplotlib  # noqa: F401  (the plot extra is part of the dev environment)

    plot_sweep(results, trace, str(tmp_path / "sweep.png"))
    plot_run(results[0], trace, str(tmp_path / "run.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert (tmp_path / "run.png").stat().st_size > 0


def test_the_report_says_how_long_the_trace_spans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Timestamps are read as milliseconds; a trace written in seconds replays as one a
    thousand times shorter, which only its span gives away: the report's first line says
    it (it did not)."""
    for step_ms, span in ((1000, "3 s"), (90_000, "4.5 min"), (3_600_000, "3.0 h")):
        path = tmp_path / f"t{step_ms}.jsonl"
        write_jsonl(
            path,
            [{"timestamp": step_ms * i, "hash_ids": [1, 2]} for i in range(4)],
        )
        assert main(["replay", str(path), "--policy", "lru", "--l1-blocks", "3"]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert f"4 requests over {span} (timestamps read as ms)" in first
