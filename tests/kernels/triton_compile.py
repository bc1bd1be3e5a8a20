"""Compile kvtier's Triton kernels to a GPU's machine code on a host without one (Triton's
compiler and ptxas need no GPU), in a process of its own: the compiler's bindings are still
alive when a process ends, and nanobind reports each as a leak then, so the test session
runs this as a child (``python triton_compile.py`` prints one JSON object: for each variant
``kernel/word/align_words/sm_arch``, whether the PTX targets that architecture, the size of
the cubin, and how many 16-byte (or wider) vector loads and stores the PTX has)."""

from __future__ import annotations

import itertools
import json
import re

KERNELS = ("runs", "pages gather", "pages scatter")
WORDS = (("i64", 2), ("i64", 1), ("u8", 1))
ARCHS = (80, 90)


def compile_one(kernel: str, word: str, align_words: int, arch: int) -> dict[str, object]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvtier.kernels import triton_copy

    constexprs: dict[str, object] = {"BLOCK": triton_copy.BLOCK_WORDS, "ALIGN_WORDS": align_words}
    if kernel == "runs":
        fn = triton.jit(triton_copy._copy_runs_kernel)
        signature = {"base": f"*{word}", "src_off": "*i64", "dst_off": "*i64", "length": "*i64"}
    else:
        fn = triton.jit(triton_copy._copy_pages_kernel)
        signature = {"base": f"*{word}", "cols": "*i64", "pages": "*i64", "starts": "*i64"}
        signature |= {"num_cols": "i32", "GATHER": "constexpr"}
        constexprs["GATHER"] = kernel == "pages gather"
    signature |= {"BLOCK": "constexpr", "ALIGN_WORDS": "constexpr"}
    # What Triton's launcher tells the compiler of 16-byte-aligned tensors: the pointers are.
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=aligned)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    ptx = compiled.asm["ptx"]
    return {
        "targets_arch": f".target sm_{arch}" in ptx,
        "cubin_bytes": len(compiled.asm["cubin"]),
        "vector_accesses": len(re.findall(r"\b(?:ld|st)\.global(?:\.\w+)*\.v[24]\.", ptx)),
    }


def key(kernel: str, word: str, align_words: int, arch: int) -> str:
    return f"{kernel}/{word}/{align_words}/sm_{arch}"


if __name__ == "__main__":
    out = {
        key(k, w, a, arch): compile_one(k, w, a, arch)
        for k, (w, a), arch in itertools.product(KERNELS, WORDS, ARCHS)
    }
    print(json.dumps(out))
