"""add_at: per-block counts bumped at ids that may repeat."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.counts import add_at


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
def test_each_occurrence_counts_and_the_dtype_stays(dtype) -> None:
    counts = np.zeros(10, dtype=dtype)
    add_at(counts, np.array([3, 5, 3, 3, 9]), 2)
    assert counts.tolist() == [0, 0, 0, 6, 0, 2, 0, 0, 0, 2] and counts.dtype == dtype
    add_at(counts, np.array([3, 9]), -1)
    add_at(counts, np.array([5]), -2)  # one id: a scalar update
    add_at(counts, np.array([], dtype=np.int64), 7)
    assert counts.tolist() == [0, 0, 0, 5, 0, 0, 0, 0, 0, 1]
