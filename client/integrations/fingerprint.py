"""Fingerprints of the files that decide a KV cache: model checkpoints and adapters.

A namespace that names a model by its path alone would let a checkpoint rewritten in place
share blocks with its predecessor; the fingerprint binds the weight files themselves, at the
cost of a few hundred KiB read once at engine start (a few MiB for a safetensors checkpoint of
hundreds of tensors). Evenly spaced samples of a file alone missed a rewrite that changed some
tensors only (a fine-tune of the attention's K and V projections, a merged LoRA adapter): the
blocks of the old weights were then loaded for the new ones. A safetensors file is also
sampled in every tensor, so a tensor changed anywhere near its start, middle or end changes
the fingerprint (a change confined to the inside of a tensor, some rows of an embedding, say,
is still missed). Those are three small random reads per tensor, made ``READERS`` at a time:
from a cold page cache on a local virtual disk 1,000 tensors in 3 GiB took 0.15-0.23 s one
at a time, and 8,000 tensors in 1 GiB 1.0-1.2 s in parallel against 1.7 s one at a time, so
seconds for a checkpoint of tens of thousands of tensors (a large MoE), more on network
storage; ``weights_fingerprint: false`` in the namespace options turns it off.

An adapter (LoRA) is named in block keys, and an engine's own name for it (a number it
hands out) means nothing to another engine; ``AdapterDigests`` binds its files instead, read
whole (adapters are small) and once per folder while its files stay as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 16
SAMPLE_BYTES = 4096
TENSOR_SAMPLE_BYTES = 512
# A safetensors header larger than this is not read as one (the file is sampled as any other).
MAX_HEADER_BYTES = 100 << 20
# Sample reads in flight, and how many are handed to the readers at once (a bound on the
# samples held in memory: a few MiB).
READERS = 16
READ_BATCH = 4096


def same_checkpoint(a: str, b: str) -> bool:
    """Whether two model paths name one checkpoint: equal, or one local folder spelled two
    ways (a trailing slash, a symlink, a relative path). Compared as strings alone, a draft
    given as the target's folder with a trailing slash was taken for another checkpoint."""
    if a == b:
        return True
    try:
        return os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)
    except OSError:
        return False


def folder_name(path: str) -> str:
    """A local checkpoint folder's own name: the last component of the folder a symlink
    leads to (and of a path with a trailing slash), so a link named otherwise names the
    folder it leads to."""
    return os.path.basename(os.path.realpath(path))


def weights_dir_fingerprint(path: str, tag: bytes) -> str:
    """Every weight file's relative name, size and ``SAMPLES`` evenly spaced 4 KiB samples
    under ``path``, and for a safetensors file its header and a sample at the start, middle
    and end of every tensor, hashed after ``tag`` (which names the integration); 32 hex
    digits."""
    h = hashlib.sha256(tag)
    files = []
    for root, _, names in os.walk(path):
        files += [os.path.join(root, n) for n in names if n.endswith(WEIGHT_SUFFIXES)]
    with ThreadPoolExecutor(READERS, thread_name_prefix="kvtier-fingerprint") as readers:
        for file in sorted(files):
            size = os.path.getsize(file)
            h.update(f"{os.path.relpath(file, path)}|{size}|".encode())
            with open(file, "rb") as f:
                step = max(1, size // SAMPLES)
                spans = [(offset, SAMPLE_BYTES) for offset in range(0, size, step)[:SAMPLES]]
                for sample in _read(f.fileno(), spans, readers):
                    h.update(sample)
                if file.endswith(".safetensors"):
                    for sample in _read(f.fileno(), _tensor_samples(f, size, h), readers):
                        h.update(sample)
    return h.hexdigest()[:32]


def _read(fd: int, spans: list[tuple[int, int]], readers: ThreadPoolExecutor) -> Iterator[bytes]:
    """The bytes of each (offset, length) of ``fd``, in order, read ``READERS`` at a time: a
    cold or network disk serves small random reads in parallel (one after another, they
    cost a disk's latency each: about 2 s for 8,000 tensors on a local virtual disk)."""
    for start in range(0, len(spans), READ_BATCH):
        batch = spans[start : start + READ_BATCH]
        yield from readers.map(lambda span: os.pread(fd, span[1], span[0]), batch)


def _tensor_samples(f: BinaryIO, size: int, h: Any) -> list[tuple[int, int]]:
    """(offset, length) of a sample at the start, middle and end of every tensor of the
    safetensors file ``f`` (its header, read whole, goes into ``h``); none when the file
    has no header that reads as one."""
    f.seek(0)
    head = f.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else 0
    if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
        return []
    raw = f.read(length)
    try:
        header = json.loads(raw)
        spans = [
            tuple(int(x) for x in info["data_offsets"])
            for name, info in header.items()
            if name != "__metadata__"
        ]
    except (ValueError, TypeError, KeyError, AttributeError):
        return []
    h.update(raw)
    base = 8 + length
    samples = set()
    for span in spans:
        if len(span) != 2 or not 0 <= span[0] < span[1] <= size - base:
            continue
        start, end = span
        for at in (start, (start + end) // 2, max(start, end - TENSOR_SAMPLE_BYTES)):
            samples.add((base + at, min(TENSOR_SAMPLE_BYTES, end - at)))
    return sorted(samples)


def adapter_dir_digest(path: str, tag: bytes) -> str:
    """Every file directly in the adapter folder ``path`` (hidden ones aside): its name, size
    and whole content, hashed after ``tag``; 32 hex digits. Read whole, unlike a model's
    weights: two adapters of the same shape that differ in one value must differ here, and a
    file vLLM may read (weights in any format, configs) is never left out by its suffix."""
    h = hashlib.sha256(tag)
    for name, _ in _adapter_files(path):
        file = os.path.join(path, name)
        h.update(f"{name}|{os.path.getsize(file)}|".encode())
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:32]


def _adapter_files(path: str) -> list[tuple[str, tuple[int, int]]]:
    """(name, (size, mtime_ns)) of the regular files directly in ``path``, by name."""
    out = []
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_file():
                continue
            st = entry.stat()
            out.append((entry.name, (st.st_size, st.st_mtime_ns)))
    return sorted(out)


@dataclass(frozen=True)
class _Digest:
    files: list[tuple[str, tuple[int, int]]]
    digest: str


class AdapterDigests:
    """``adapter_dir_digest`` per folder, read once and again only when a file of the folder
    is added, removed, or changes size or modification time (one ``stat`` per file a call).
    The first call for a folder reads it whole in the caller's thread (a few ms for an
    adapter of a few MiB).

    Thread-safety: none; one per user thread (the vLLM connector's scheduler side).
    """

    def __init__(self, tag: bytes) -> None:
        self._tag = tag
        self._digests: dict[str, _Digest] = {}

    def digest(self, path: str) -> str | None:
        """The folder's digest, or None when ``path`` is not a readable local folder."""
        try:
            files = _adapter_files(path)
            known = self._digests.get(path)
            if known is not None and known.files == files:
                return known.digest
            digest = adapter_dir_digest(path, self._tag)
        except OSError:
            return None
        # Stamped with the listing taken before the read: a file rewritten during the read
        # differs from it next time, and is read again.
        self._digests[path] = _Digest(files, digest)
        return digest
