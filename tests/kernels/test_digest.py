"""The device-independent block digest: equal to a plain-Python reference of its definition,
and it tells apart the corruptions a direct disk read can produce."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.kernels.digest import _SEQ, P, block_digest


def _reference(data: bytes) -> int:
    """The definition, in Python integers."""
    out = 0
    for a, c, m in _SEQ:
        s = sum(x * ((a * i + c) % m + 1) for i, x in enumerate(data, start=1))
        out = (out << 31) | (s % P)
    return out


@pytest.mark.parametrize("nbytes", [1, 2, 7, 64, 4097])
def test_matches_the_definition(nbytes):
    rng = np.random.default_rng(nbytes)
    blocks = rng.integers(0, 256, (3, nbytes), dtype=np.uint8)
    got = block_digest(torch.from_numpy(blocks))
    assert got == [_reference(row.tobytes()) for row in blocks]
    assert all(0 <= d < 1 << 62 for d in got)


def test_detects_the_corruptions_of_a_direct_read():
    rng = np.random.default_rng(0)
    block = torch.from_numpy(rng.integers(0, 256, 64 << 10, dtype=np.uint8))
    base = block_digest(block[None])[0]
    variants = []
    flipped = block.clone()
    flipped[12345] ^= 1
    variants.append(flipped)
    zeroed = block.clone()
    zeroed[8192:12288] = 0  # a page never written
    variants.append(zeroed)
    swapped = block.clone()
    swapped[0:4096], swapped[4096:8192] = block[4096:8192].clone(), block[0:4096].clone()
    variants.append(swapped)
    torn = block.clone()
    torn[32768:] = 0xFF
    variants.append(torn)
    digests = block_digest(torch.stack(variants))
    assert base not in digests and len(set(digests)) == len(digests)
    assert block_digest(block.clone()[None])[0] == base


def test_sums_stay_exact_at_the_largest_values():
    # All bytes 0xFF: the sums are as large as they get for this length; float64 must not
    # round them.
    block = torch.full((1, 1 << 20), 0xFF, dtype=torch.uint8)
    assert block_digest(block) == [_reference(bytes(block[0].numpy()))]


def test_refuses_other_shapes():
    with pytest.raises(ValueError):
        block_digest(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError):
        block_digest(torch.zeros((1, 8), dtype=torch.int8))


@pytest.mark.gpu
def test_the_gpu_computes_the_same_digest():
    blocks = torch.randint(0, 256, (8, (2 << 20) + 3), dtype=torch.uint8)
    assert block_digest(blocks.cuda()) == block_digest(blocks)
