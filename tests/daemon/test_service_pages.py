"""KVService's check of a request's pages: one per key, and a Get's all distinct."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvtier.daemon.errors import InvalidArgument
from kvtier.daemon.service import KVService

POOL = SimpleNamespace(check_pages=lambda pages: None)


def _pages(pages: list[int], *, unique: bool) -> np.ndarray:
    return KVService._pages(POOL, pages, len(pages), unique=unique)  # type: ignore[arg-type]


def test_a_get_naming_a_page_twice_is_refused_wherever_the_two_stand():
    """The distinct pages' check sorts them (np.unique cost a large Get's first step 0.4-0.7
    ms): a page named twice is found apart, side by side, at both ends, and in two pages."""
    rng = np.random.default_rng(57)
    pages = rng.permutation(1 << 20)[:4096].tolist()
    assert _pages(pages, unique=True).tolist() == pages
    for first, second in [(0, 4095), (4095, 0), (1000, 1001), (17, 3000)]:
        twice = list(pages)
        twice[second] = twice[first]
        with pytest.raises(InvalidArgument, match="a page appears twice"):
            _pages(twice, unique=True)
        assert _pages(twice, unique=False).tolist() == twice  # a Put may read a page twice
    with pytest.raises(InvalidArgument, match="a page appears twice"):
        _pages([5, 5], unique=True)
    assert _pages([5, 6], unique=True).tolist() == [5, 6]
    assert _pages([5], unique=True).tolist() == [5]
