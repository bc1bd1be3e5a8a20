"""Layout descriptors against real torch tensors: every chunk offset must point at the bytes
the engine's own tensor indexing reaches."""

from __future__ import annotations

import pytest
import torch

from kvtier.kernels.layout import LayerLayout, LayoutError, PoolLayout

L, P, T, H, D = 3, 5, 4, 2, 8


def _byte_offset(t: torch.Tensor, base: torch.Tensor) -> int:
    return t.data_ptr() - base.data_ptr()


def _check(layout: PoolLayout, chunk_of) -> None:
    """chunk_of(layer, kv, page) -> the engine's tensor view of that chunk."""
    t = layout.chunk_table
    offs = t.pool_offsets(torch.arange(P).numpy()).reshape(P, -1)
    c = 0
    for layer in range(L):
        for kv in range(2):
            for page in range(P):
                chunk = chunk_of(layer, kv, page)
                assert chunk.is_contiguous()
                assert int(offs[page, c]) == chunk.data_ptr() - BASE.data_ptr()
                assert int(t.length[c]) == chunk.numel() * chunk.element_size()
            c += 1
    assert layout.block_bytes == L * 2 * T * H * D * 2


BASE = torch.zeros(L * 2 * P * T * H * D, dtype=torch.float16)


def test_vllm_layout_matches_tensor_indexing():
    layers = BASE.view(L, 2, P, T, H, D)
    layout = PoolLayout.vllm(
        num_layers=L, num_pages=P, block_tokens=T, num_kv_heads=H, head_dim=D, dtype="float16"
    )
    _check(layout, lambda layer, kv, page: layers[layer][kv, page])
    layout.validate(BASE.numel() * 2)


def test_flashinfer_layout_matches_tensor_indexing():
    layers = BASE.view(L, P, 2, T, H, D)
    layout = PoolLayout.flashinfer(
        num_layers=L, num_pages=P, block_tokens=T, num_kv_heads=H, head_dim=D, dtype="float16"
    )
    _check(layout, lambda layer, kv, page: layers[layer][page, kv])
    layout.validate(BASE.numel() * 2)


def test_staging_layout_is_one_contiguous_block_per_page():
    pages = BASE.view(P, L, 2, T * H * D)
    layout = PoolLayout.staging(
        num_layers=L, num_pages=P, block_tokens=T, chunk_bytes=T * H * D * 2, dtype="float16"
    )
    _check(layout, lambda layer, kv, page: pages[page, layer, kv])
    t = layout.chunk_table
    offs = t.pool_offsets(torch.arange(P).numpy()).reshape(P, -1)
    # Chunks of a page follow each other: the copy kernel merges them into one range.
    assert all(int(offs[p, 0]) == p * layout.block_bytes for p in range(P))
    assert (offs[:, 1:] - offs[:, :-1] == t.length[:-1]).all()


def test_validate_accepts_exact_fit_and_rejects_one_byte_short():
    layout = PoolLayout.vllm(
        num_layers=L, num_pages=P, block_tokens=T, num_kv_heads=H, head_dim=D, dtype="float16"
    )
    layout.validate(layout.extent_bytes)
    with pytest.raises(LayoutError, match="beyond the region"):
        layout.validate(layout.extent_bytes - 1)


def one(**kw):
    base = dict(offset=0, kv_count=2, kv_stride=64, page_stride=128, chunk_bytes=64)
    base.update(kw)
    return PoolLayout((LayerLayout(**base),), num_pages=4, block_tokens=1, dtype="uint8")


@pytest.mark.parametrize(
    "layout, message",
    [
        (PoolLayout((), 4, 1, "uint8"), "no layers"),
        (one(kv_count=3), "kv_count"),
        (one(chunk_bytes=0), "chunk_bytes must be positive"),
        (one(page_stride=32), "pages overlap"),
        (one(kv_stride=32), "K and V chunks overlap"),
        (one(kv_stride=128 + 32), "K and V chunks overlap"),
        (PoolLayout((LayerLayout(0, 1, 0, 8, 3),), 4, 1, "float16"), "not a multiple"),
        (PoolLayout((LayerLayout(0, 1, 0, 8, 8),), 4, 1, "complex64"), "unknown dtype"),
        (PoolLayout((LayerLayout(0, 1, 0, 8, 8),), 0, 1, "uint8"), "num_pages"),
        (PoolLayout((LayerLayout(-8, 1, 0, 8, 8),), 4, 1, "uint8"), "negative"),
    ],
)
def test_validate_rejects(layout, message):
    with pytest.raises(LayoutError, match=message):
        layout.validate(1 << 20)


HUGE = 10**5000


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: one(kv_count=HUGE).validate(1 << 20), r"^layer 0: kv_count: an int of 16610 bits"),
        (lambda: one(chunk_bytes=HUGE).validate(1 << 20), r"^layer 0: chunk_bytes: an int of "),
        (lambda: one(kv_stride=-HUGE).validate(1 << 20), r"^layer 0: kv_stride: a negative int "),
        (lambda: one(chunk_bytes="64").validate(1 << 20), r"^layer 0: chunk_bytes: expected int"),
        (lambda: one(page_stride=1.5).validate(1 << 20), r"^layer 0: page_stride: expected int"),
        (lambda: one(offset=True).validate(1 << 20), r"^layer 0: offset: expected int, not bool"),
        (
            lambda: PoolLayout(((0, 1, 0, 8, 8),), 4, 1, "uint8").validate(1 << 20),  # type: ignore[arg-type]
            r"^layer 0: expected LayerLayout, not tuple$",
        ),
        (
            lambda: PoolLayout((LayerLayout(0, 1, 0, 8, 8),), HUGE, 1, "uint8").validate(1 << 20),
            r"^num_pages: an int of 16610 bits",
        ),
        (
            lambda: PoolLayout((LayerLayout(0, 1, 0, 8, 8),), 4, None, "uint8").validate(1 << 20),  # type: ignore[arg-type]
            r"^block_tokens: expected int, not NoneType$",
        ),
        (
            lambda: PoolLayout((LayerLayout(0, 1, 0, 8, 8),), 4, 1, HUGE).validate(1 << 20),  # type: ignore[arg-type]
            r"^unknown dtype an int of 16610 bits; one of ",
        ),
        (
            lambda: PoolLayout((LayerLayout(0, 1, 0, 8, 8),), 4, 1, []).validate(1 << 20),  # type: ignore[arg-type]
            r"^unknown dtype \[\]; one of ",
        ),
        (
            lambda: PoolLayout.vllm(
                num_layers=1, num_pages=4, block_tokens=1, num_kv_heads=1, head_dim=8, dtype=HUGE
            ),  # type: ignore[arg-type]
            r"^unknown dtype an int of 16610 bits; one of ",
        ),
        (
            lambda: PoolLayout.vllm(
                num_layers=1, num_pages=4, block_tokens=1, num_kv_heads=1, head_dim=8, dtype={}
            ),  # type: ignore[arg-type]
            r"^unknown dtype \{\}; one of ",
        ),
        (
            lambda: PoolLayout.staging(num_layers=2.5, num_pages=4, block_tokens=1, chunk_bytes=8),
            r"^num_layers: expected int, not float$",
        ),
        (
            lambda: PoolLayout.staging(num_layers="2", num_pages=4, block_tokens=1, chunk_bytes=8),  # type: ignore[arg-type]
            r"^num_layers: expected int, not str$",
        ),
    ],
)
def test_regression_a_layout_of_huge_or_wrong_values_failed_with_pythons_error(make, message):
    """A layout's value past 4,300 digits failed ``validate``'s own refusal with Python's
    ValueError (an int it cannot print), a dtype that is no str raised TypeError (a list:
    unhashable) or that ValueError from the refusal's repr, and a field or a layer count of
    the wrong type raised TypeError from a comparison or ``range``: the client's checks of a
    CUDA or SGLang pool, and every builder, raised those untyped. Each is a LayoutError (a
    ValueError) naming the field; the wire holds no field past 64 bits, so neither may a
    layout."""
    with pytest.raises(LayoutError, match=message):
        make()


def test_kv_chunks_far_apart_do_not_overlap():
    # vLLM's K block and V block: V starts after all K pages.
    one(kv_stride=4 * 128).validate(1 << 20)
    # Interleaved K/V within a page (FlashInfer).
    one(kv_stride=64, page_stride=128).validate(1 << 20)
