"""``kvtier bench ttft`` at a tiny size: interleaved runs of all three, speedups, logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchjson import assert_ratio, run_json


@pytest.mark.slow  # a model and three daemon restarts, ~6 s: `make test-slow`
def test_ttft_bench_interleaves_recompute_l1_and_cold_l2(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    f = run_json(
        "ttft",
        *("--prompt-tokens", "96", "--prefix-tokens", "64", "--block-tokens", "32"),
        *("--reps", "1", "--l2-dir", str(tmp_path), "--keep-cache"),
        report="(iii) L2 load, cold",
    )
    assert f["threads"] == threads, "torch's default threading is kept"
    assert (f["reps"], f["prefix_tokens"], f["block_tokens"]) == (1, 64, 32)
    assert f["page_cache_dropped"] is False
    for kind in ("recompute", "l1", "l2"):
        assert len(f["all_s"][kind]) == 1 and f["all_s"][kind][0] > 0, kind
    assert_ratio(f, "l1_speedup", f["recompute_s"], f["l1_s"])
    assert_ratio(f, "l2_speedup", f["recompute_s"], f["l2_s"])
    # Loaded prefixes give the recomputed logits (up to float reassociation across threads).
    assert f["max_logit_diff"] < 1e-3
    assert f["first_token_mismatches"] == 0
    assert not any(tmp_path.iterdir()), "the L2 folder is removed"
