"""Engine KV pools as an engine holds them (torch tensors, one per layer), for tests of the
device data plane. The reference block of a page is built from the engine's own tensor
indexing, independently of any offset arithmetic under test."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.kernels.layout import LayerLayout, PoolLayout
from kvtier.kernels.runs import Buffer

LAYOUTS = ("vllm", "flashinfer", "mla", "staging")
DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
}


@dataclass
class EnginePool:
    kind: str
    tensors: list[torch.Tensor]  # what the engine indexes
    layout: PoolLayout  # in pool space
    buffers: list[Buffer]  # where each tensor sits in pool space

    @property
    def segments(self) -> list[torch.Tensor]:
        return [flat_bytes(t) for t in self.tensors]

    def block(self, page: int) -> torch.Tensor:
        """The stored block of ``page``: its chunks layer by layer, K before V."""
        parts: list[torch.Tensor] = []
        if self.kind == "staging":
            return flat_bytes(self.tensors[0][page]).clone()
        for t in self.tensors:
            if self.kind == "vllm":
                parts += [flat_bytes(t[0, page]), flat_bytes(t[1, page])]
            elif self.kind == "flashinfer":
                parts += [flat_bytes(t[page, 0]), flat_bytes(t[page, 1])]
            else:  # mla
                parts.append(flat_bytes(t[page]))
        return torch.cat(parts)

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for seg in self.segments:
            seg.copy_(torch.randint(0, 256, (seg.numel(),), dtype=torch.uint8, generator=g))
        self._settle()

    def poison(self, value: int = 0xA5) -> None:
        for seg in self.segments:
            seg.fill_(value)
        self._settle()

    def _settle(self) -> None:
        # On a GPU the fills run on the default stream; the tier's copies run on their own.
        if self.tensors[0].is_cuda:
            torch.cuda.synchronize()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, sharing its memory."""
    assert t.is_contiguous()
    return t.view(-1).view(torch.uint8)


def make_pool(
    kind: str,
    *,
    layers: int = 3,
    pages: int = 9,
    tokens: int = 4,
    heads: int = 2,
    head_dim: int = 8,
    dtype: str = "float16",
    gap: int = 0,
    device: str | torch.device = "cpu",
) -> EnginePool:
    """A pool of ``kind``; per-layer tensors sit ``gap`` bytes apart in pool space (a gap
    makes pool offsets differ from a packed layout's)."""
    td = DTYPES[dtype]
    item = torch.empty(0, dtype=td).element_size()
    if kind == "staging":
        t = torch.zeros((pages, layers, 2, tokens * heads * head_dim), dtype=td, device=device)
        chunk = tokens * heads * head_dim * item
        layout = PoolLayout.staging(
            num_layers=layers, num_pages=pages, block_tokens=tokens, chunk_bytes=chunk, dtype=dtype
        )
        return EnginePool(kind, [t], layout, [Buffer(0, t.numel() * item)])
    if kind == "vllm":
        shape: tuple[int, ...] = (2, pages, tokens, heads, head_dim)
    elif kind == "flashinfer":
        shape = (pages, 2, tokens, heads, head_dim)
    elif kind == "mla":
        shape = (pages, tokens, heads * head_dim)
    else:
        raise ValueError(kind)
    tensors = [torch.zeros(shape, dtype=td, device=device) for _ in range(layers)]
    chunk = tokens * heads * head_dim * item
    layer_bytes = tensors[0].numel() * item
    buffers, lls = [], []
    for i in range(layers):
        off = i * (layer_bytes + gap)
        buffers.append(Buffer(off, layer_bytes))
        if kind == "vllm":
            lls.append(LayerLayout(off, 2, pages * chunk, chunk, chunk))
        elif kind == "flashinfer":
            lls.append(LayerLayout(off, 2, chunk, 2 * chunk, chunk))
        else:
            lls.append(LayerLayout(off, 1, 0, chunk, chunk))
    return EnginePool(kind, tensors, PoolLayout(tuple(lls), pages, tokens, dtype), buffers)
