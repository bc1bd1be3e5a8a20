"""Optional int8 / fp8 (e4m3) quantisation of stored blocks, with per-token-group scales.

Off by default: a tier stores a block's bytes exactly unless it is configured to quantise.
A block of a float pool is viewed as its elements (layer by layer, K before V, each chunk
``[tokens, heads, head_dim]``); consecutive runs of ``group_size`` elements share one float32
scale (``amax / qmax``). ``group_size`` divides the elements of one token's row in a chunk
(``heads * head_dim``, or the latent width for MLA), so a group never straddles two tokens.

A quantised block is one contiguous extent: ``E`` bytes of codes, then ``E / group_size``
float32 scales (little-endian), so it fits any slot tier as is. Error bounds (per element,
before the result is rounded back to the pool's dtype; ``a`` is the group's amax):

- int8: ``|x - x'| <= a / 254`` (round to nearest of 255 levels).
- fp8 e4m3: ``|x - x'| <= |x| / 16 + a / 448 * 2**-10`` (3 mantissa bits; subnormals near 0).

``measure_error`` reports what a round trip really lost. Written against torch tensors:
the same code runs on the CPU in the tests and on the GPU in a tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.kernels.layout import DTYPE_ITEMSIZE, PoolLayout

KINDS = ("int8", "fp8_e4m3")
_SOURCE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


class QuantError(ValueError):
    """A block or spec that cannot be quantised (wrong dtype, non-finite values)."""


@dataclass(frozen=True, slots=True)
class QuantSpec:
    kind: str  # int8 or fp8_e4m3
    dtype: str  # the pool's dtype: float16, bfloat16, float32
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise QuantError(f"unknown quantisation {self.kind!r}; one of {', '.join(KINDS)}")
        if self.dtype not in _SOURCE:
            raise QuantError(
                f"blocks of {self.dtype} are not quantised; only {', '.join(_SOURCE)} are"
            )
        if self.group_size < 1:
            raise QuantError("group_size must be positive")

    @classmethod
    def for_layout(cls, layout: PoolLayout, kind: str, group_size: int = 128) -> QuantSpec:
        """A spec whose groups stay inside one token's row of every chunk of ``layout``."""
        itemsize = DTYPE_ITEMSIZE[layout.dtype]
        group = group_size
        for layer in layout.layers:
            row = layer.chunk_bytes // itemsize // layout.block_tokens
            if row * layout.block_tokens * itemsize != layer.chunk_bytes:
                raise QuantError("a chunk is not a whole number of token rows")
            from math import gcd

            group = gcd(group, row)
        return cls(kind, layout.dtype, group)

    def elements(self, block_bytes: int) -> int:
        itemsize = DTYPE_ITEMSIZE[self.dtype]
        if block_bytes % itemsize or (block_bytes // itemsize) % self.group_size:
            raise QuantError(
                f"a block of {block_bytes} bytes is not a whole number of "
                f"{self.group_size}-element groups of {self.dtype}"
            )
        return block_bytes // itemsize

    def quantised_bytes(self, block_bytes: int) -> int:
        e = self.elements(block_bytes)
        return e + 4 * (e // self.group_size)


def quantize_blocks(blocks: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``[n, block_bytes]`` uint8 blocks -> ``[n, spec.quantised_bytes(block_bytes)]`` uint8.

    Raises QuantError when a block holds a non-finite value (it could not be restored)."""
    n, block_bytes = _check_blocks(blocks)
    e = spec.elements(block_bytes)
    x = blocks.view(_SOURCE[spec.dtype]).float().view(n, e // spec.group_size, spec.group_size)
    if not bool(torch.isfinite(x).all()):
        raise QuantError("a block holds NaN or infinite values; it is stored unquantised")
    amax = x.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / _QMAX[spec.kind], torch.ones_like(amax))
    y = x / scale
    if spec.kind == "int8":
        codes = y.round().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty(
        (n, spec.quantised_bytes(block_bytes)), dtype=torch.uint8, device=blocks.device
    )
    out[:, :e] = codes.view(n, e)
    out[:, e:] = scale.view(n, -1).contiguous().view(torch.uint8)
    return out


def dequantize_blocks(quantised: torch.Tensor, spec: QuantSpec, block_bytes: int) -> torch.Tensor:
    """The inverse of ``quantize_blocks``: ``[n, block_bytes]`` uint8 blocks of ``spec.dtype``."""
    n, qbytes = _check_blocks(quantised)
    e = spec.elements(block_bytes)
    if qbytes != spec.quantised_bytes(block_bytes):
        raise QuantError(f"{qbytes} bytes is not a quantised block of {block_bytes}")
    groups = e // spec.group_size
    codes = quantised[:, :e].contiguous()
    scale = quantised[:, e:].contiguous().view(torch.float32).view(n, groups, 1)
    if spec.kind == "int8":
        y = codes.view(torch.int8).float()
    else:
        y = codes.view(torch.float8_e4m3fn).float()
    x = (y.view(n, groups, spec.group_size) * scale).to(_SOURCE[spec.dtype])
    return x.view(n, e).view(torch.uint8).view(n, block_bytes)


@dataclass(frozen=True, slots=True)
class ErrorReport:
    """What a quantised round trip lost, over all elements of the blocks compared."""

    max_abs: float
    mean_abs: float
    rel_rms: float  # ||x - x'|| / ||x||
    max_over_group_amax: float  # max |x - x'| / amax of the element's group
    compression: float  # quantised bytes / original bytes


def measure_error(original: torch.Tensor, restored: torch.Tensor, spec: QuantSpec) -> ErrorReport:
    """Compare ``[n, block_bytes]`` blocks before and after a round trip."""
    n, block_bytes = _check_blocks(original)
    e = spec.elements(block_bytes)
    src = _SOURCE[spec.dtype]
    x = original.view(src).double().view(n, e // spec.group_size, spec.group_size)
    y = restored.view(src).double().view(n, e // spec.group_size, spec.group_size)
    err = (x - y).abs()
    amax = x.abs().amax(dim=2, keepdim=True)
    rel_group = torch.where(amax > 0, err / amax, err)
    norm = float(torch.linalg.vector_norm(x))
    return ErrorReport(
        max_abs=float(err.max()),
        mean_abs=float(err.mean()),
        rel_rms=float(torch.linalg.vector_norm(x - y)) / norm if norm else 0.0,
        max_over_group_amax=float(rel_group.max()),
        compression=spec.quantised_bytes(block_bytes) / block_bytes,
    )


def _check_blocks(blocks: torch.Tensor) -> tuple[int, int]:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise QuantError("blocks must be a contiguous [n, bytes] uint8 tensor")
    return int(blocks.shape[0]), int(blocks.shape[1])
