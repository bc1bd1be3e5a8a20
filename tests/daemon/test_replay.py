"""The trace replayer: exact semantics, the reference figures, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.daemon import tracegen
from kvtier.daemon.replay import (
    Trace,
    format_sweep,
    load_trace,
    replay,
    sweep,
    sweep_capacities,
    trace_from_requests,
)

# The public trace lives in the shared folder beside the checkout; KVTIER_TRACES points
# elsewhere when the checkout is not in its usual place.
SHARED_TRACE = Path(
    os.environ.get("KVTIER_TRACES", Path(__file__).resolve().parents[2].parent / "shared/traces")
)
MOONCAKE = SHARED_TRACE / "mooncake_synthetic_trace.jsonl"


def requests(*chains: list[int]) -> list[dict[str, object]]:
    return [{"timestamp": 1000 * i, "hash_ids": ids} for i, ids in enumerate(chains)]


def reference_lru_hits(chains: list[list[int]], capacity: int) -> int:
    """A plain single-tier LRU, independent of the package."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids in chains:
        missing = [b for b in ids if b not in cache]
        hits += len(ids) - len(missing)
        for b in ids:
            if b in cache and b not in missing:
                cache.move_to_end(b)
        for b in missing:
            if b not in cache:
                if len(cache) >= capacity:
                    cache.popitem(last=False)
                cache[b] = None
    return hits


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    if not MOONCAKE.exists():
        pytest.skip(f"{MOONCAKE} is not here")
    return load_trace(MOONCAKE)


def test_lru_equals_a_plain_lru() -> None:
    reqs = tracegen.scenario("chat", seed=3, duration_s=300.0)
    chains = [list(r["hash_ids"]) for r in reqs]
    # Repeats within a request, too.
    chains += [[5, 6, 5, 7, 6], [7, 5, 9, 9]]
    trace = trace_from_requests(requests(*chains))
    for capacity in (1, 7, 100, 1000, 5000):
        result = replay(trace, "lru", capacity)
        assert result.hits == reference_lru_hits(chains, capacity), capacity


def test_opt_on_a_hand_checked_trace() -> None:
    # a b c a b d a with room for 2 (positions 0..6). Belady with bypass:
    # a, b fill; c is next used never, later than a (3) and b (4): bypassed;
    # a, b hit; d (never again) ties with b (never again): b goes; a hits. 3 hits.
    trace = trace_from_requests(requests([1], [2], [3], [1], [2], [4], [1]))
    result = replay(trace, "opt", 2)
    assert result.hits == 3 and result.declined == {"l1:later": 1}
    assert replay(trace, "lru", 2).hits == 0


def test_hits_prefix_hits_and_request_order() -> None:
    trace = trace_from_requests(requests([1, 2, 3], [1, 4, 3], [1, 2, 3]))
    r = replay(trace, "lru", 10)
    # Request 2: 1 and 3 hit, 4 misses: prefix run is 1. Request 3: 1, 2, 3 hit.
    assert (r.hits, r.prefix_hits) == (5, 4)
    assert r.tier_hits == {"l1": 5}
    assert r.hits_per_request.tolist() == [0, 2, 3]


def test_two_tiers_demote_and_promote() -> None:
    trace = trace_from_requests(requests([1], [2], [3], [1], [1, 2, 3]))
    r = replay(trace, "lru", 1, 2)
    # [1] [2]: 1 demoted; [3]: 2 demoted (L2 = 1, 2); [1]: L2 hit, promoted, 3 demoted
    # (L2 = 2, 3); [1, 2, 3]: 1 in L1, 2 and 3 in L2.
    assert r.tier_hits == {"l1": 1, "l2": 3}
    assert r.hits == 4 and r.promotions == 3
    assert r.evictions["l1"] >= 3


def test_admission_can_decline() -> None:
    trace = trace_from_requests(requests([1], [2], [1], [3], [1]))
    r = replay(trace, "lru", 1, admission="second_hit")
    assert r.declined.get("l1:first_seen", 0) >= 2
    assert r.hits == 1


def test_reference_figures_on_the_public_trace(mooncake: Trace) -> None:
    cap = sweep_capacities(mooncake.unique_blocks)[0]  # 1%: 439 blocks
    assert cap == 439
    figures = {
        name: round(100 * replay(mooncake, name, cap).hit_ratio, 2)
        for name in ("lru", "arc", "opt")
    }
    assert figures == {"lru": 3.80, "arc": 4.18, "opt": 18.54}


def test_heat_beats_lru_and_arc_at_five_percent(mooncake: Trace) -> None:
    cap = sweep_capacities(mooncake.unique_blocks)[2]
    heat, lru, arc = (replay(mooncake, name, cap).hit_ratio for name in ("heat", "lru", "arc"))
    assert heat > lru and heat > arc


def test_cli_json_is_the_last_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    tracegen.write_jsonl(path, requests([1, 2], [1, 2, 3], [4], [1, 2, 3]))
    rc = main(["replay", str(path), "--policy", "lru", "--l1-blocks", "3", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    doc = json.loads(out[-1])
    assert {
        "policy",
        "l1_blocks",
        "l2_blocks",
        "accesses",
        "hits",
        "hit_ratio",
        "prefix_hit_ratio",
        "tier_hits",
        "accesses_per_s",
    } <= set(doc)
    assert (doc["policy"], doc["l1_blocks"], doc["l2_blocks"]) == ("lru", 3, 0)
    assert (doc["accesses"], doc["hits"]) == (9, 4)
    assert doc["tier_hits"] == {"l1": 4}
    assert "block accesses/s" in "\n".join(out)


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, ["--l1-blocks", "4"], "no such file"),
        ('{"timestamp": 0, "hash_ids": [1]}\nnot json\n', ["--l1-blocks", "4"], ":2: not valid"),
        ('{"timestamp": 0, "hash_ids": [1, "a"]}\n', ["--l1-blocks", "4"], ":1: 'hash_ids'"),
        ('{"hash_ids": [1]}\n', ["--l1-blocks", "4"], ":1: 'timestamp'"),
        ('{"timestamp": 0, "hash_ids": [1]}\n', [], "--l1-blocks is required"),
        ('{"timestamp": 0, "hash_ids": [1]}\n', ["--l1-blocks", "4", "--admission", "x"], "x"),
    ],
)
def test_cli_errors(
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


@pytest.mark.parametrize("flag", ["--l1-blocks", "--l2-blocks"])
def test_cli_refuses_negative_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["replay", str(tmp_path / "t.jsonl"), "--l1-blocks", "2", flag, "-1"])
    assert e.value.code == 2
    assert "must be at least" in capsys.readouterr().err


def test_cli_exit_code_and_no_traceback_as_a_process(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1, "hash_ids": 3}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "replay", str(path), "--l1-blocks", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert ":2:" in proc.stderr and "Traceback" not in proc.stderr


def test_sweep_table_and_plot(tmp_path: Path) -> None:
    trace = trace_from_requests(tracegen.scenario("chat", seed=1, duration_s=120.0))
    results = sweep(trace, policies=("heat", "lru"), percents=(5, 20))
    table = format_sweep(results, trace.unique_blocks)
    assert table.splitlines()[1].startswith("heat") and "heat speed" in table
    pytest.importorskip("matplotlib")
    from kvtier.daemon.replay import plot_run, plot_sweep

    plot_sweep(results, trace, str(tmp_path / "sweep.png"))
    plot_run(results[0], trace, str(tmp_path / "run.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert (tmp_path / "run.png").stat().st_size > 0
