"""int8 / fp8 (e4m3) block quantisation: round trips stay within their stated error bounds,
element by element, for every float dtype and for KV-like data with outlier channels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_pools import make_pool

from kvtier.kernels.quant import (
    QuantError,
    QuantSpec,
    dequantize_blocks,
    measure_error,
    quantize_blocks,
)

# Half an ulp of each pool dtype, relative: the rounding of the restored value itself.
HALF_ULP = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}


def kv_like_blocks(pool, n: int, seed: int) -> torch.Tensor:
    """Blocks whose elements look like keys and values: unit normals, a few channels of
    every row 20x larger (the outliers that make per-tensor scales useless)."""
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors:
        x = torch.randn(t.shape, generator=g)
        x[..., ::37] *= 20.0
        t.copy_(x.to(t.dtype))
    return torch.stack([pool.block(p) for p in range(n)])


def _bound(kind: str, dtype: str, x: torch.Tensor, y: torch.Tensor, amax: torch.Tensor):
    rounding = y.abs() * HALF_ULP[dtype]
    if kind == "int8":
        return amax / 254 + rounding + 1e-12
    return x.abs() / 16 + amax / 448 * 2.0**-10 + rounding + 1e-12


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["vllm", "mla"])
def test_round_trip_error_is_within_the_bound(kind, dtype, layout):
    pool = make_pool(layout, layers=2, pages=6, tokens=16, heads=2, head_dim=64, dtype=dtype)
    blocks = kv_like_blocks(pool, 6, seed=7)
    spec = QuantSpec.for_layout(pool.layout, kind)
    assert spec.group_size == 128 if layout == "vllm" else 128
    q = quantize_blocks(blocks, spec)
    assert q.shape == (6, spec.quantised_bytes(pool.layout.block_bytes))
    back = dequantize_blocks(q, spec, pool.layout.block_bytes)
    assert back.shape == blocks.shape

    src = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    g = spec.group_size
    x = blocks.view(src).double().view(6, -1, g)
    y = back.view(src).double().view(6, -1, g)
    amax = x.abs().amax(dim=2, keepdim=True)
    err = (x - y).abs()
    bound = _bound(kind, dtype, x, y, amax)
    assert bool((err <= bound).all())

    report = measure_error(blocks, back, spec)
    assert report.max_abs == pytest.approx(float(err.max()))
    limit = {"int8": 1 / 254, "fp8_e4m3": 1 / 16}[kind]
    assert report.max_over_group_amax <= limit + HALF_ULP[dtype] + 1e-9
    assert report.rel_rms <= float(torch.linalg.vector_norm(bound) / torch.linalg.vector_norm(x))
    assert report.rel_rms < {"int8": 0.03, "fp8_e4m3": 0.05}[kind]  # KV-like data, measured
    itemsize = torch.empty(0, dtype=src).element_size()
    assert report.compression == pytest.approx((1 + 4 / g) / itemsize)


def test_format_is_codes_then_float32_scales():
    spec = QuantSpec("int8", "float32", group_size=4)
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    q = quantize_blocks(x.view(torch.uint8).view(1, -1), spec)
    assert q.shape == (1, 8 + 2 * 4)
    codes = q[0, :8].view(torch.int8).tolist()
    scales = q[0, 8:].contiguous().view(torch.float32).tolist()
    assert codes == [64, -127, 32, 0, 0, 0, 0, 0]
    assert scales == pytest.approx([2.0 / 127, 1.0])  # an all-zero group keeps scale 1
    back = dequantize_blocks(q, spec, 32).view(torch.float32)
    assert back[0, 4:].tolist() == [0.0] * 4  # zeros stay exactly zero
    assert back[0, 1].item() == -2.0  # the group's amax is exact


def test_quantisation_is_deterministic_and_zero_blocks_are_exact():
    pool = make_pool("vllm", layers=1, pages=2, tokens=4, heads=2, head_dim=64, dtype="bfloat16")
    blocks = kv_like_blocks(pool, 2, seed=3)
    spec = QuantSpec.for_layout(pool.layout, "fp8_e4m3")
    assert torch.equal(quantize_blocks(blocks, spec), quantize_blocks(blocks.clone(), spec))
    zeros = torch.zeros_like(blocks)
    assert torch.equal(
        dequantize_blocks(quantize_blocks(zeros, spec), spec, blocks.shape[1]), zeros
    )


def test_bad_input_is_refused():
    with pytest.raises(QuantError, match="unknown quantisation"):
        QuantSpec("int4", "float16")
    with pytest.raises(QuantError, match="not quantised"):
        QuantSpec("int8", "int8")
    spec = QuantSpec("int8", "float32", group_size=4)
    nan = torch.tensor([[1.0, float("nan"), 0.0, 0.0]]).view(torch.uint8).view(1, -1)
    with pytest.raises(QuantError, match="NaN"):
        quantize_blocks(nan, spec)
    with pytest.raises(QuantError, match="whole number"):
        quantize_blocks(torch.zeros((1, 12), dtype=torch.uint8), spec)
    with pytest.raises(QuantError, match="not a quantised block"):
        dequantize_blocks(torch.zeros((1, 7), dtype=torch.uint8), spec, 16)
    with pytest.raises(QuantError, match="uint8"):
        quantize_blocks(torch.zeros(16, dtype=torch.uint8), spec)


def test_groups_never_straddle_tokens():
    # 48 elements per token row: a 128 group would cross rows, so the spec takes 16.
    pool = make_pool("vllm", layers=2, pages=2, tokens=4, heads=3, head_dim=16, dtype="float16")
    assert QuantSpec.for_layout(pool.layout, "int8").group_size == 16
    rows = np.gcd(48, 32)
    assert QuantSpec.for_layout(pool.layout, "int8", group_size=32).group_size == rows
