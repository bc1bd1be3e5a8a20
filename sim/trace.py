"""Traces in the Mooncake format: reading, writing, and the two accounting semantics.

A trace is one JSON object a line, sorted by ``timestamp`` (ms since start): ``hash_ids`` is
the request's prefix chain, one id per block of ``block_tokens`` tokens (512 in Mooncake's
traces), equal ids being the same block; ``input_length`` (tokens) and ``output_length`` are
optional. When ``input_length`` is not a multiple of the block size, the request's last id
names a *partial* block.

Semantics (``Trace.cacheable``):

- ``full`` (the default, the daemon's): only full blocks have keys, so a partial last block
  is never stored and is not a cacheable access: it is dropped from the request.
- ``all`` (the replayer's semantics before the tier stack, kept for comparison with figures
  published under it): every id is a cacheable block.

Invariants of ``Trace``: block ids are below ``unique_blocks`` and dense (every id in
``0 .. unique_blocks - 1`` used, numbered in order of the original ids, which may be any
JSON integers, past 64 bits too), except in a
selection (``select``), which keeps its parent's ids; ``offsets`` has one more entry than
there are requests and is non-decreasing, and timestamps follow the file's order (not
necessarily sorted; the engine holds its clock back from going backwards).

Thread-safety: traces are immutable values.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import gzip
import json
import lzma
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

DEFAULT_BLOCK_TOKENS = 512
SEMANTICS = ("full", "all")


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests as flat arrays: request ``r`` accesses ``blocks[offsets[r]:offsets[r + 1]]``.

    ``partial[r]`` says whether request ``r``'s last block is partial (its ``input_length`` is
    known and not a multiple of ``block_tokens``)."""

    name: str
    timestamps_s: np.ndarray  # float64, one per request
    offsets: np.ndarray  # int64, requests + 1
    blocks: np.ndarray  # int64 dense block ids, one per access
    unique_blocks: int
    partial: np.ndarray  # bool, one per request
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    @property
    def requests(self) -> int:
        return len(self.timestamps_s)

    @property
    def accesses(self) -> int:
        return len(self.blocks)

    @property
    def span_s(self) -> float:
        return float(self.timestamps_s[-1] - self.timestamps_s[0]) if self.requests else 0.0

    def cacheable(self, semantics: str = "full") -> Trace:
        """The trace as a cache sees it under ``semantics`` (see the module docstring)."""
        if semantics not in SEMANTICS:
            raise ValueError(f"unknown semantics {semantics!r}; one of {', '.join(SEMANTICS)}")
        if semantics == "all" or not self.partial.any():
            return self
        keep = np.ones(self.accesses, dtype=bool)
        last = self.offsets[1:] - 1
        drop = self.partial & (self.offsets[1:] > self.offsets[:-1])
        keep[last[drop]] = False
        lengths = np.diff(self.offsets) - drop
        uniq, dense = np.unique(self.blocks[keep], return_inverse=True)
        return Trace(
            name=self.name,
            timestamps_s=self.timestamps_s,
            offsets=np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
            blocks=dense.astype(np.int64).reshape(-1),
            unique_blocks=len(uniq),
            partial=np.zeros(self.requests, dtype=bool),
            block_tokens=self.block_tokens,
        )

    def request(self, r: int) -> np.ndarray:
        return self.blocks[self.offsets[r] : self.offsets[r + 1]]

    def select(self, requests: np.ndarray) -> Trace:
        """The requests ``requests`` (indices, ascending) as a trace of their own, keeping
        this trace's block ids and ``unique_blocks`` (the nodes of a cluster agree on ids;
        some ids are then unused)."""
        requests = np.asarray(requests, dtype=np.int64)
        lo, hi = self.offsets[requests], self.offsets[requests + 1]
        lengths = hi - lo
        starts = np.repeat(lo - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        positions = starts + np.arange(int(lengths.sum()), dtype=np.int64)
        return Trace(
            name=self.name,
            timestamps_s=self.timestamps_s[requests],
            offsets=np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
            blocks=self.blocks[positions],
            unique_blocks=self.unique_blocks,
            partial=self.partial[requests],
            block_tokens=self.block_tokens,
        )


def load_trace(path: str | Path, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Trace:
    """Read a Mooncake-format JSONL trace, UTF-8 (a byte order mark is skipped), plain or
    compressed with gzip, bzip2 or xz (known by its first bytes, not its name), from a file
    or a pipe. Raises TraceError naming the line at fault."""
    path = Path(path)
    name = str(path)
    kind = "text"
    lines = _Lines(name)
    try:
        # Opened once and peeked at, not read: a pipe cannot be read from the start again.
        with path.open("rb") as raw:
            kind, opener = _format(name, raw.peek(8)[:8])
            with opener(raw) if opener else contextlib.nullcontext(raw) as data:
                return _parse(lines.of(data), name, block_tokens)
    except FileNotFoundError:
        raise TraceError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{name}: is a directory") from None
    except (EOFError, zlib.error, lzma.LZMAError) as e:
        raise TraceError(
            f"{name}: its {kind} data is cut short or corrupt {lines.after} ({e})"
        ) from None
    except OSError as e:
        if kind != "text" and e.errno is None:  # the decompressor's, not the file system's
            raise TraceError(
                f"{name}: its {kind} data is cut short or corrupt {lines.after} ({e})"
            ) from None
        raise TraceError(f"{name}: {e.strerror or e}") from None


class _Lines:
    """A binary stream's lines as text, counted, each decoded on its own so that a byte that
    is not UTF-8 is named by its line. A byte order mark is skipped; ``\\n``, ``\\r\\n`` and a
    lone ``\\r`` end a line (no raw ``\\r`` can be inside a JSON value)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.read = 0

    @property
    def after(self) -> str:
        """Where a read that failed stopped."""
        return f"after line {self.read}" if self.read else "before its first line"

    def of(self, data: Iterable[bytes]) -> Iterator[str]:
        for raw in data:
            # A byte order mark starts the file, or a line where files were concatenated.
            body = raw.removeprefix(codecs.BOM_UTF8).removesuffix(b"\n").removesuffix(b"\r")
            for piece in body.split(b"\r"):
                self.read += 1
                try:
                    yield piece.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise TraceError(
                        f"{self.name}:{self.read}: not UTF-8 text ({e.reason})"
                    ) from None


Opener = Callable[[IO[bytes]], contextlib.AbstractContextManager[Iterable[bytes]]]
# Compressed traces are read as they are; the formats the standard library cannot read are
# named, so that the error says what to do.
_COMPRESSED: dict[bytes, tuple[str, Opener]] = {
    b"\x1f\x8b": ("gzip", lambda raw: gzip.GzipFile(fileobj=raw)),
    b"BZh": ("bzip2", bz2.BZ2File),
    b"\xfd7zXZ\x00": ("xz", lzma.LZMAFile),
}
_UNREADABLE = {b"\x28\xb5\x2f\xfd": "zstd", b"PK\x03\x04": "zip"}


def _format(name: str, head: bytes) -> tuple[str, Opener | None]:
    """The compression ``head`` (a file's first bytes) starts with, and what decompresses
    it; ``("text", None)`` for none."""
    for magic, (kind, opener) in _COMPRESSED.items():
        if head.startswith(magic):
            return kind, opener
    for magic, kind in _UNREADABLE.items():
        if head.startswith(magic):
            raise TraceError(f"{name}: {kind}-compressed; decompress it first")
    return "text", None


def trace_from_requests(
    requests: Iterable[Mapping[str, Any]],
    name: str = "<memory>",
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> Trace:
    """A trace from request objects shaped like the file's lines (for generators, tests)."""
    return _parse((json.dumps(dict(r)) for r in requests), name, block_tokens)


def write_jsonl(path: str | Path, requests: Iterable[Mapping[str, Any]]) -> int:
    """Write requests one JSON object a line; returns the number written."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(dict(r), separators=(", ", ": ")) + "\n")
            n += 1
    return n


def _parse(lines: Iterable[str], name: str, block_tokens: int) -> Trace:
    if block_tokens < 1:
        raise ValueError("block_tokens must be at least 1")
    stamps: list[float] = []
    offsets = [0]
    ids: list[int] = []
    partial: list[bool] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise TraceError(f"{where}: JSON nested too deeply to read") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object")
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not _finite(ts):
            raise TraceError(f"{where}: 'timestamp' must be a finite number of milliseconds")
        hashes = obj.get("hash_ids")
        if not isinstance(hashes, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hashes
        ):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
        tokens = obj.get("input_length")
        if isinstance(tokens, float) and tokens.is_integer():
            tokens = int(tokens)  # 512.0: from a writer that holds a column with gaps as floats
        if tokens is None:
            partial.append(False)
        elif isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise TraceError(f"{where}: 'input_length' must be a whole number of tokens")
        else:
            if len(hashes) != -(-tokens // block_tokens):
                raise TraceError(
                    f"{where}: {len(hashes)} hash_ids for an input_length of {tokens} tokens; "
                    f"expected ceil({tokens} / {block_tokens}) = {-(-tokens // block_tokens)} "
                    "(is the block size --block-tokens right?)"
                )
            partial.append(tokens % block_tokens != 0)
        stamps.append(float(ts) / 1000.0)
        ids.extend(hashes)
        offsets.append(len(ids))
    dense, unique = _renumbered(ids)
    return Trace(
        name=name,
        timestamps_s=np.asarray(stamps, dtype=np.float64),
        offsets=np.asarray(offsets, dtype=np.int64),
        blocks=dense,
        unique_blocks=unique,
        partial=np.asarray(partial, dtype=bool),
        block_tokens=block_tokens,
    )


def _finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer past any float
        return False


def _renumbered(ids: list[int]) -> tuple[np.ndarray, int]:
    """Dense ids in the order of the original ids, and how many there are."""
    try:
        raw = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        # Ids past int64 (unsigned 64-bit hashes, longer ones) are ids like any other: only
        # their equality matters, so Python's integers renumber them, in the same order.
        ordered = sorted(set(ids))
        index = {h: i for i, h in enumerate(ordered)}
        dense = np.fromiter(map(index.__getitem__, ids), dtype=np.int64, count=len(ids))
        return dense, len(ordered)
    uniq, inverse = np.unique(raw, return_inverse=True)
    return inverse.astype(np.int64).reshape(-1), len(uniq)


def next_uses(blocks: np.ndarray) -> np.ndarray:
    """For each access, the position of the next access of the same block (inf if none)."""
    order = np.argsort(blocks, kind="stable")  # stable: positions ascend within a block
    nxt = np.full(len(blocks), np.inf)
    if len(blocks) > 1:
        same = blocks[order[1:]] == blocks[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
    return nxt
