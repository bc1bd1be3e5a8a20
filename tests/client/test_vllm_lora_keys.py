"""The vLLM connector keys a LoRA adapter by its files, not by the engine's number for it,
and no adapter name, folder, cache salt or multimodal identifier can forge another's key."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

from kvtier.client.integrations.fingerprint import AdapterDigests
from kvtier.client.integrations.vllm_config import LORA_TAG, KeyChain, lora_key, request_extras
from kvtier.client.keys import Namespace

NS = Namespace(model="m", kv_dtype="bfloat16", block_tokens=4)
TOKENS = list(range(12))


def _adapter(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def _lora(name: str, int_id: int, path: Path | str) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=str(path))


def _keys(lora: SimpleNamespace, digests: AdapterDigests) -> list[bytes]:
    key = lora_key(lora, digests)
    assert key is not None
    request = SimpleNamespace(lora_request=lora, cache_salt=None, mm_features=None)
    extras = request_extras(request, NS.block_tokens, 3, key)
    return KeyChain(NS).extend(TOKENS, 3, extras)


def test_lora_adapters_with_one_name_and_id_but_other_files_get_other_keys(tmp_path):
    """Two engines (or one after a restart) may give the same name and lora_int_id to
    different adapters: keyed by name and id, engine B would load blocks computed with
    engine A's adapter."""
    digests = AdapterDigests(LORA_TAG)
    a = _adapter(tmp_path / "a", b"\x01" * 4096)
    b = _adapter(tmp_path / "b", b"\x01" * 4095 + b"\x02")  # one value differs, same size
    assert _keys(_lora("tuned", 1, a), digests) != _keys(_lora("tuned", 1, b), digests)
    # The same folder rewritten with other weights (same size) is another adapter too.
    before = _keys(_lora("tuned", 1, a), digests)
    (a / "adapter_model.safetensors").write_bytes(b"\x03" * 4096)
    os.utime(a / "adapter_model.safetensors", ns=(1, 1))
    assert _keys(_lora("tuned", 1, a), digests) != before


def test_lora_adapter_keys_do_not_depend_on_the_engines_int_id(tmp_path):
    digests = AdapterDigests(LORA_TAG)
    a = _adapter(tmp_path / "a", b"\x01" * 4096)
    assert _keys(_lora("tuned", 1, a), digests) == _keys(_lora("tuned", 7, a), digests)
    # A fresh cache (another engine, a restart) derives the same keys.
    assert _keys(_lora("tuned", 7, a), AdapterDigests(LORA_TAG)) == _keys(
        _lora("tuned", 1, a), digests
    )
    # Without an adapter the keys differ from every adapter's.
    plain = KeyChain(NS).extend(TOKENS, 3, None)
    assert plain != _keys(_lora("tuned", 1, a), digests)


def test_lora_adapter_relative_path_resolves_as_vllm_does(tmp_path, monkeypatch):
    digests = AdapterDigests(LORA_TAG)
    a = _adapter(tmp_path / "a", b"\x01" * 64)
    monkeypatch.chdir(tmp_path)
    assert lora_key(_lora("tuned", 1, "a"), digests) == lora_key(_lora("tuned", 1, a), digests)


def test_a_lora_adapter_that_is_not_a_local_folder_has_no_key(tmp_path):
    """A hub id is downloaded by vLLM's worker, and what it holds cannot be known here: such
    requests are not cached rather than keyed by a name that may mean other files later."""
    digests = AdapterDigests(LORA_TAG)
    assert lora_key(_lora("tuned", 1, "some-org/some-adapter"), digests) is None
    assert lora_key(_lora("tuned", 1, tmp_path / "missing"), digests) is None
    (tmp_path / "file").write_bytes(b"x")
    assert lora_key(_lora("tuned", 1, tmp_path / "file"), digests) is None


def test_adapter_digests_read_a_folder_once_while_its_files_stay(tmp_path):
    digests = AdapterDigests(LORA_TAG)
    a = _adapter(tmp_path / "a", b"\x01" * 4096)
    weights = a / "adapter_model.safetensors"
    first = digests.digest(str(a))
    stamp = weights.stat()
    # Same size and modification time: the cached digest stands (no re-read) ...
    weights.write_bytes(b"\x05" * 4096)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert digests.digest(str(a)) == first
    # ... which a fresh read shows is stale, and a touched file is read again.
    fresh = AdapterDigests(LORA_TAG).digest(str(a))
    assert fresh != first
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1))
    assert digests.digest(str(a)) == fresh
    # A file added (vLLM reads new_embeddings.* too) changes it; hidden ones do not.
    (a / ".cache").mkdir()
    (a / ".lock").write_bytes(b"x")
    assert digests.digest(str(a)) == fresh
    (a / "new_embeddings.safetensors").write_bytes(b"e")
    assert digests.digest(str(a)) != fresh
    # A copy elsewhere has the same digest: the folder's path is not part of it.
    shutil.copytree(a, tmp_path / "copy")
    assert digests.digest(str(tmp_path / "copy")) == digests.digest(str(a))


def _mm(identifier: str, offset: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(
        identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length)
    )


def _first_extra(lora: str, salt: str | None, mm: list[SimpleNamespace]) -> bytes:
    request = SimpleNamespace(cache_salt=salt, mm_features=mm)
    extras = request_extras(request, NS.block_tokens, 3, lora)
    return extras[0] if extras is not None else b""


def test_crafted_adapter_names_and_salts_cannot_collide(tmp_path):
    """Regression: the fields were joined as text ("lora=NAME|FOLDER|DIGEST;salt=SALT"), so
    adapter ``n`` with salt ``x|F2|D2`` and an adapter named ``n|F|D;salt=x`` in folder F2
    without a salt gave the same bytes: one request could load the other's KV. Every pair
    of different (adapter, salt, multimodal items) below must give different bytes."""
    digests = AdapterDigests(LORA_TAG)
    plain = _adapter(tmp_path / "plain", b"\x01" * 64)
    odd = _adapter(tmp_path / "odd;salt=x|y%3B", b"\x02" * 64)
    dp, do = digests.digest(str(plain)), digests.digest(str(odd))
    assert dp is not None and do is not None
    names = ["n", f"n|{plain}|{dp}", f"n|{plain}|{dp};salt=x", "n;salt=x", "n%3Bsalt=x", "n|"]
    salts = [None, "x", f"x|{odd}|{do}", f"x|{plain}|{dp}", "x;mm=i@0+1", "x%3Bmm=i@0+1", "%"]
    mms = [[], [_mm("i", 0, 1)], [_mm("i@0+1;mm=i", 0, 1)], [_mm("i", 0, 1), _mm("i", 0, 1)]]
    loras = [""] + [
        key
        for name, folder in itertools.product(names, (plain, odd))
        if (key := lora_key(_lora(name, 1, folder), digests)) is not None
    ]
    assert len(loras) == 1 + 2 * len(names)
    seen: dict[bytes, tuple[object, ...]] = {}
    for case in itertools.product(range(len(loras)), salts, range(len(mms))):
        extra = _first_extra(loras[case[0]], case[1], mms[case[2]])
        assert seen.setdefault(extra, case) == case, (extra, seen[extra], case)


def test_keys_of_names_and_salts_without_delimiters_are_unchanged(tmp_path):
    """The escaping leaves ordinary text as it was: keys stored before it stay valid."""
    digests = AdapterDigests(LORA_TAG)
    folder = _adapter(tmp_path / "tuned-adapter", b"\x01" * 64)
    digest = digests.digest(str(folder))
    key = lora_key(_lora("tuned v2", 1, folder), digests)
    assert key == f"tuned v2|{folder}|{digest}"
    mm = [_mm("0a1b2c", 1, 2)]
    assert _first_extra(key, "tenant-7=blue", mm) == (
        f"lora={key};salt=tenant-7=blue;mm=0a1b2c@1+2".encode()
    )
    assert _first_extra("", "s", []) == b"salt=s"
    assert _first_extra("", None, mm) == b"mm=0a1b2c@1+2"
