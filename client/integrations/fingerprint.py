"""Cheap fingerprints of a model checkpoint folder, for namespaces.

A namespace that names a model by its path alone would let a checkpoint rewritten in place
share blocks with its predecessor; the fingerprint binds the weight files themselves, at the
cost of a few hundred KiB read once at engine start.
"""

from __future__ import annotations

import hashlib
import os

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 16
SAMPLE_BYTES = 4096


def weights_dir_fingerprint(path: str, tag: bytes) -> str:
    """Every weight file's relative name, size and ``SAMPLES`` evenly spaced 4 KiB samples
    under ``path``, hashed after ``tag`` (which names the integration, so each keeps the
    values it always had); 32 hex digits."""
    h = hashlib.sha256(tag)
    files = []
    for root, _, names in os.walk(path):
        files += [os.path.join(root, n) for n in names if n.endswith(WEIGHT_SUFFIXES)]
    for file in sorted(files):
        size = os.path.getsize(file)
        h.update(f"{os.path.relpath(file, path)}|{size}|".encode())
        with open(file, "rb") as f:
            step = max(1, size // SAMPLES)
            for offset in range(0, size, step)[:SAMPLES]:
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:32]
