"""Every benchmark refuses counts it cannot measure with, before it starts anything: ``bench
l3 --rounds 0`` ran no round and then failed its read-back check as "the tier read back
different bytes"; ``bench policy_memory --blocks -1`` ended in a numpy traceback."""

from __future__ import annotations

import pytest

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
        ("restart", ["--rows", "0"], "counts must be at least 1"),
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
