"""Helpers the benchmarks share: statistics, the page cache, scratch folders, pool layouts.

Nothing here talks to a daemon; the benchmarks do that through ``kvtier.client`` only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from kvtier.bench.jsonout import JSON_HELP
from kvtier.client import PoolLayout

MiB = 1 << 20
GiB = 1 << 30
PAGE = 4096


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache; False where this process may not
    (not root, or /proc/sys read-only in a container)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def pct_ms(seconds: Sequence[float] | np.ndarray, q: float) -> float:
    """The ``q``-th percentile of ``seconds``, in milliseconds."""
    return float(np.percentile(np.asarray(seconds, dtype=np.float64), q) * 1e3)


def sig(value: float, digits: int = 4) -> float:
    """``value`` rounded to ``digits`` significant digits, for output."""
    return float(f"{value:.{digits}g}")


def latency_figures(seconds: np.ndarray) -> dict[str, float]:
    """Median, 99th percentile and worst of a phase's call latencies (``seconds``), in
    milliseconds, and how many calls it made."""
    return {
        "p50_ms": sig(pct_ms(seconds, 50)),
        "p99_ms": sig(pct_ms(seconds, 99)),
        "max_ms": sig(float(seconds.max()) * 1e3),
        "calls": len(seconds),
    }


def ratio(value: float | None, baseline: float | None) -> float | None:
    """``value / baseline`` to 4 significant digits; None when either side was not measured."""
    if value is None or baseline is None or baseline <= 0:
        return None
    return sig(value / baseline)


def fmt_list(values: Sequence[float], digits: int = 3) -> str:
    return "[" + ", ".join(f"{v:.{digits}f}" for v in values) + "]"


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``64MiB``, ``4GiB``, ``1.5GB`` (the daemon's config syntax)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    units.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
    s = text.strip().lower()
    num = s.rstrip("kmgtib")
    unit = s[len(num) :]
    if unit not in units or not num:
        raise ValueError(f"not a size: {text!r} (e.g. 4096, 64MiB, 4GiB)")
    return int(float(num) * units[unit])


def scratch_folder(parent: str | None, prefix: str) -> Path:
    """A fresh folder inside ``parent`` (made if missing; default: the system temp folder).
    One that cannot be made (a file there, a folder this user may not write) ends the
    benchmark with a line saying so, not a traceback."""
    try:
        if parent is not None:
            os.makedirs(parent, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as e:
        raise SystemExit(
            f"kvtier bench: cannot make a scratch folder in {parent}: {e.strerror or e}"
        ) from None


@contextlib.contextmanager
def scratch_dir(parent: str | None, prefix: str, *, keep: bool = False) -> Iterator[Path]:
    """A fresh folder inside ``parent`` (default: the system temp folder), removed on exit
    unless ``keep``."""
    path = scratch_folder(parent, prefix)
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def block_layout(block_bytes: int, num_pages: int, *, num_layers: int | None = None) -> PoolLayout:
    """A vLLM-style pool whose blocks are ``block_bytes``: layers x K,V of 16-token float16
    chunks with one KV head (the head width makes up the size). Without ``num_layers``, the
    most layers (up to 32) whose chunks stay at least 4 KiB."""
    if num_layers is None:
        fits = [n for n in (32, 16, 8, 4, 2) if block_bytes % (n * 64) == 0]
        num_layers = next((n for n in fits if block_bytes // (2 * n) >= 4096), 1)
    per_head_dim = num_layers * 2 * 16 * 2  # layers x K,V x tokens x itemsize
    if block_bytes % per_head_dim:
        raise ValueError(
            f"a block of {block_bytes} bytes does not split into {num_layers} layers x K,V "
            f"of 16 float16 tokens; use a multiple of {per_head_dim}"
        )
    return PoolLayout.vllm(
        num_layers=num_layers,
        num_pages=num_pages,
        block_tokens=16,
        num_kv_heads=1,
        head_dim=block_bytes // per_head_dim,
        dtype="float16",
    )


def tag_pages(
    pool: np.ndarray, layout: PoolLayout, pages: Sequence[int], tags: Sequence[int]
) -> None:
    """Write ``tags[i]`` into the first 8 bytes of page ``pages[i]`` (its first chunk), so a
    block read back can be told from the others."""
    table = layout.chunk_table
    base, stride = int(table.pool_base[0]), int(table.page_stride[0])
    for page, tag in zip(pages, tags, strict=True):
        at = base + page * stride
        pool[at : at + 8] = np.frombuffer(int(tag).to_bytes(8, "little"), dtype=np.uint8)


def read_tags(pool: np.ndarray, layout: PoolLayout, pages: Sequence[int]) -> list[int]:
    table = layout.chunk_table
    base, stride = int(table.pool_base[0]), int(table.page_stride[0])
    return [
        int.from_bytes(pool[base + p * stride : base + p * stride + 8].tobytes(), "little")
        for p in pages
    ]


def arg_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``kvtier bench NAME``: its ``--help`` prints the module docstring (what
    is measured, against what) and the options with their defaults. ``--json`` is listed
    there, but ``kvtier bench`` reads it before the benchmark runs (``run_bench``)."""
    p = argparse.ArgumentParser(
        prog=f"kvtier bench {name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    return p
