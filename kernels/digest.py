"""A block digest that the CPU and the GPU compute identically: for blocks read straight
into device memory (GPUDirect Storage), where hashing on the host would cost the copy that
GDS saves.

With the block's bytes ``x_1..x_n`` and two weight sequences ``u_i = (A*i + B) mod 65521 + 1``
and ``v_i = (C*i + D) mod 65519 + 1`` (both below ``2**16``, never zero, with coprime
periods), the sums ``s = sum x_i u_i`` and ``t = sum x_i v_i`` are exact integers below
``2**53`` for blocks up to 512 MiB. They are computed as one float64 matrix product, which is
exact for such integers whatever the summation order, so the result is the same on every
device. The digest is ``(s mod P) << 31 | (t mod P)`` with ``P = 2**31 - 1`` (62 bits).

Any change confined to one byte changes both sums (``|delta * w| < P``); zeroed, swapped or
torn pages escape with a probability of about ``2**-62``. Not a defence against an adversary.
"""

from __future__ import annotations

import functools

import torch

P = (1 << 31) - 1
_SEQ = ((48_271, 11, 65_521), (16_807, 7, 65_519))  # (multiplier, offset, modulus)
MAX_BYTES = 512 << 20


@functools.lru_cache(maxsize=4)
def _weights(nbytes: int, device: str) -> torch.Tensor:
    i = torch.arange(1, nbytes + 1, dtype=torch.int64)
    cols = [(i * a + c) % m + 1 for a, c, m in _SEQ]
    return torch.stack(cols, dim=1).to(torch.float64).to(device)


def block_digest(blocks: torch.Tensor) -> list[int]:
    """Digests of ``[n, nbytes]`` uint8 blocks (any device), as Python ints."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError("blocks must be an [n, bytes] uint8 tensor")
    nbytes = blocks.shape[1]
    if nbytes > MAX_BYTES:
        raise ValueError(f"blocks of more than {MAX_BYTES} bytes")
    sums = blocks.to(torch.float64) @ _weights(int(nbytes), str(blocks.device))
    out = []
    for s, t in sums.cpu().tolist():
        out.append(((int(s) % P) << 31) | (int(t) % P))
    return out
