"""The weights fingerprint that binds a model's namespace to its checkpoint's files."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from kvtier.client.integrations.fingerprint import SAMPLE_BYTES, SAMPLES, weights_dir_fingerprint

TAG = b"test"
TENSORS, TENSOR_BYTES = 64, 16 << 10


def _checkpoint(folder: Path, data: list[bytes]) -> Path:
    """A safetensors file of ``data``'s tensors (bf16 vectors), written as safetensors does."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for i, tensor in enumerate(data):
        span = [offset, offset + len(tensor)]
        header[f"layers.{i}.k_proj.weight"] = {
            "dtype": "BF16",
            "shape": [len(tensor) // 2],
            "data_offsets": span,
        }
        offset += len(tensor)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(data))
    return path


def _unsampled_tensor(path: Path) -> int:
    """A tensor that none of the file's evenly spaced samples reads."""
    size = path.stat().st_size
    base = size - TENSORS * TENSOR_BYTES
    step = size // SAMPLES
    windows = [(at, at + SAMPLE_BYTES) for at in range(0, size, step)[:SAMPLES]]
    for i in range(TENSORS):
        start, end = base + i * TENSOR_BYTES, base + (i + 1) * TENSOR_BYTES
        if all(e <= start or s >= end for s, e in windows):
            return i
    raise AssertionError("every tensor is sampled; make the tensors smaller")


def test_a_checkpoint_rewritten_in_place_in_one_tensor_gets_another_fingerprint(tmp_path):
    """Before, only 16 evenly spaced 4 KiB samples of each file were hashed: a checkpoint
    rewritten in place with new values in some tensors only (a fine-tune of the K and V
    projections, a merged adapter), of the same size, kept its fingerprint, so an engine
    loaded the KV blocks of the old weights for the new ones (seen with a real vLLM: the
    outputs differed from the engine's own without kvtier)."""
    data = [os.urandom(TENSOR_BYTES) for _ in range(TENSORS)]
    path = _checkpoint(tmp_path, data)
    first = weights_dir_fingerprint(str(tmp_path), TAG)
    assert weights_dir_fingerprint(str(tmp_path), TAG) == first
    changed = _unsampled_tensor(path)
    data[changed] = os.urandom(TENSOR_BYTES)
    _checkpoint(tmp_path, data)
    assert weights_dir_fingerprint(str(tmp_path), TAG) != first


def test_the_same_weights_written_again_keep_their_fingerprint(tmp_path):
    """Engines that load copies of one checkpoint (another folder, another write) share
    blocks: nothing but the files' names, sizes and bytes counts."""
    data = [os.urandom(TENSOR_BYTES) for _ in range(TENSORS)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _checkpoint(tmp_path / "a", data)
    _checkpoint(tmp_path / "b", data)
    os.utime(tmp_path / "b" / "model.safetensors", (1, 1))
    assert weights_dir_fingerprint(str(tmp_path / "a"), TAG) == weights_dir_fingerprint(
        str(tmp_path / "b"), TAG
    )


def test_a_file_named_safetensors_that_is_not_one_is_sampled_as_any_other(tmp_path):
    path = tmp_path / "model.safetensors"
    for content in (b"", b"\xff" * 8 + b"x" * 100, struct.pack("<Q", 10) + b"not json!!"):
        path.write_bytes(content)
        assert len(weights_dir_fingerprint(str(tmp_path), TAG)) == 32
    path.write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"a")
    first = weights_dir_fingerprint(str(tmp_path), TAG)
    path.write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"b")
    assert weights_dir_fingerprint(str(tmp_path), TAG) != first


def test_samples_read_in_parallel_hash_as_read_one_after_another(tmp_path: Path) -> None:
    """The readers change how the samples are read, not the fingerprint: it is the hash of
    each file's name and size, its evenly spaced samples, its header and its tensors'
    samples in file order, as a plain reader makes it (a namespace changes only with the
    files). More than one batch of reads, so the batches' order counts too."""
    import hashlib

    from kvtier.client.integrations import fingerprint as fp

    data = [bytes([i % 251]) * 2048 + os.urandom(2048) for i in range(1500)]
    path = _checkpoint(tmp_path, data)
    size = path.stat().st_size
    with open(path, "rb") as f:
        h = hashlib.sha256(TAG)
        h.update(f"model.safetensors|{size}|".encode())
        for offset in range(0, size, max(1, size // SAMPLES))[:SAMPLES]:
            f.seek(offset)
            h.update(f.read(SAMPLE_BYTES))
        spans = fp._tensor_samples(f, size, h)
        assert len(spans) > fp.READ_BATCH
        for offset, length in spans:
            f.seek(offset)
            h.update(f.read(length))
    assert weights_dir_fingerprint(str(tmp_path), TAG) == h.hexdigest()[:32]
