"""The SGLang backend's options, page format, namespace and keys (no SGLang needed; the
backend itself is tested against SGLang's real classes by `make test-sglang`)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.client.integrations.sglang_config import (
    PAGE_KEY_TAG,
    DraftModel,
    PageFormat,
    StorageOptions,
    describe_host_pool,
    draft_fingerprint,
    model_weights,
    namespace_for,
    storage_key,
)
from kvtier.client.keys import Namespace

SGLANG_OWN = {
    "backend_name": "kvtier",
    "module_path": "kvtier.client.integrations.sglang",
    "class_name": "KVTierHiCacheStorage",
    "interface_v1": 1,
    "allocator": "shm",
}


def test_options_ignore_sglangs_own_keys_and_take_ours() -> None:
    opts = StorageOptions.from_extra_config(
        {**SGLANG_OWN, "address": "unix:/x.sock", "io_timeout_s": 2, "namespace": {"model": "m"}}
    )
    assert opts.address == "unix:/x.sock" and opts.io_timeout_s == 2.0
    assert opts.namespace.model == "m" and opts.namespace.tenant == "default"
    assert StorageOptions.from_extra_config(None) == StorageOptions()


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"adress": "x"}, r"unknown key\(s\) \['adress'\]"),
        ({"namespace": {"modle": "x"}}, r"namespace.*unknown key\(s\) \['modle'\]"),
        ({"namespace": "m"}, "must be a dict"),
        ({"io_timeout_s": "5"}, "io_timeout_s.*must be a number"),
        ({"io_timeout_s": True}, "io_timeout_s.*must be a number"),
        ({"staging_bytes": 1.5}, "staging_bytes.*must be an integer"),
        ({"register_host_pool": 1}, "register_host_pool.*true or false"),
        ({"lookup_timeout_s": 0}, "lookup_timeout_s.*positive"),
        ({"late_copy_grace_s": -1}, "late_copy_grace_s.*negative"),
        # inf passed and failed later in a thread (gRPC's deadline, Event.wait, time.sleep).
        ({"retry_after_s": float("inf")}, "retry_after_s.*finite"),
        ({"io_timeout_s": float("inf")}, "io_timeout_s.*finite"),
        ({"late_copy_grace_s": float("inf")}, "late_copy_grace_s.*finite"),
    ],
)
def test_bad_options_name_the_key(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StorageOptions.from_extra_config({**SGLANG_OWN, **extra})


def test_storage_key_follows_the_spec() -> None:
    seed = Namespace(model="m", kv_dtype="float16", block_tokens=4).seed()
    page_hash = "ab" * 32
    data = page_hash.encode()
    want = hashlib.sha256(PAGE_KEY_TAG + seed + struct.pack("<I", len(data)) + data).digest()
    assert storage_key(seed, page_hash) == want
    # Golden vector (README): another implementation must produce exactly this.
    assert seed.hex() == "813b8c9b8e47c275ecc4ea043d806d50d3391d2c72b38fbaaf8ef7064cd47817"
    assert want.hex() == "cf335806e0492ea94ddeee8a7fab1fffd15fd1b3195a468b7d4605f711ff0e30"
    assert storage_key(seed, page_hash) != storage_key(seed, page_hash + "x")


def _config(**kw: Any) -> SimpleNamespace:
    base = dict(
        model_name="org/model",
        tp_rank=1,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        dcp_size=1,
        dcp_rank=0,
    )
    return SimpleNamespace(**{**base, **kw})


def _page(**kw: Any) -> PageFormat:
    base = dict(
        pool_class="MHATokenToKVPoolHost",
        layout="page_first",
        dtype="bfloat16",
        page_tokens=64,
        num_pages=10,
        page_numel=100,
        itemsize=2,
        geometry="layers=2,heads=8,head_dim=128,v_head_dim=128",
        format_tag="",
        segments=None,
    )
    return PageFormat(**{**base, **kw})  # type: ignore[arg-type]


def test_namespace_binds_model_dtype_layout_page_and_rank() -> None:
    ns = namespace_for(_config(), _page(), StorageOptions())
    assert (ns.model, ns.kv_dtype, ns.kv_layout, ns.block_tokens) == (
        "org/model",
        "bfloat16",
        "sglang/page_first",
        64,
    )
    assert (ns.tp_rank, ns.tp_size, ns.pp_rank, ns.pp_size) == (1, 2, 0, 1)
    assert "pool=MHATokenToKVPoolHost" in ns.extra and "heads=8" in ns.extra
    assert "weights=hub" in ns.extra
    seeds = {
        namespace_for(c, p, StorageOptions()).seed()
        for c, p in [
            (_config(), _page()),
            (_config(model_name="org/other"), _page()),
            (_config(tp_rank=0), _page()),
            (_config(pp_size=2), _page()),
            (_config(attn_cp_size=2), _page()),
            (_config(), _page(dtype="float16")),
            (_config(), _page(layout="layer_first")),
            (_config(), _page(page_tokens=32)),
            (_config(), _page(pool_class="MLATokenToKVPoolHost")),
            (_config(), _page(geometry="layers=3")),
            (_config(), _page(format_tag="mxfp8")),
        ]
    }
    assert len(seeds) == 11


def test_mla_namespace_is_shared_by_every_tp_rank() -> None:
    mla = [
        namespace_for(_config(is_mla_model=True, tp_rank=r), _page(), StorageOptions())
        for r in (0, 1)
    ]
    assert mla[0] == mla[1] and (mla[0].tp_rank, mla[0].tp_size) == (0, 1)
    assert "tp=replicated" in mla[0].extra


def test_namespace_options_override_and_model_is_required() -> None:
    opts = StorageOptions.from_extra_config(
        {"namespace": {"model": "mine", "revision": "r1", "tenant": "t", "extra": "x"}}
    )
    ns = namespace_for(_config(), _page(), opts)
    assert (ns.model, ns.revision, ns.tenant) == ("mine", "r1", "t")
    assert ns.extra.endswith(";user=x")
    with pytest.raises(ValueError, match="no model name"):
        namespace_for(_config(model_name=None), _page(), StorageOptions())


def test_weights_fingerprint_follows_a_local_checkpoint(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 10_000)
    first = model_weights(str(tmp_path), "", True)
    assert first not in ("hub", "off")
    # SGLang appends the pool's format tag to the model name.
    assert model_weights(f"{tmp_path}-mxfp8", "mxfp8", True) == first
    weights.write_bytes(b"a" * 9_999 + b"b")
    assert model_weights(str(tmp_path), "", True) != first
    assert model_weights(str(tmp_path), "", False) == "off"
    assert model_weights("org/model", "", True) == "hub"


def test_a_packed_draft_is_bound_by_its_name_and_weight_files(tmp_path: Path) -> None:
    def draft(path: Path | str, **kw: Any) -> DraftModel:
        base = dict(algorithm="EAGLE", revision="main", load_format="auto", quantization="")
        return DraftModel(**{**base, "path": str(path), "own": False, **kw})  # type: ignore[arg-type]

    for folder in ("one/mtp", "two/mtp", "three/mtp"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "one/mtp/model.bin").write_bytes(b"a" * 5000)
    (tmp_path / "two/mtp/model.bin").write_bytes(b"a" * 5000)
    (tmp_path / "three/mtp/model.bin").write_bytes(b"b" * 5000)
    one = draft_fingerprint(draft(tmp_path / "one/mtp"), True)
    assert len(one) == 32
    # The same files at another path are the same draft; other files are not.
    assert draft_fingerprint(draft(tmp_path / "two/mtp"), True) == one
    assert draft_fingerprint(draft(tmp_path / "three/mtp"), True) != one
    # Without the weight files, the folder's path alone tells two drafts apart.
    assert draft_fingerprint(draft(tmp_path / "three/mtp"), False) != draft_fingerprint(
        draft(tmp_path / "one/mtp"), False
    )
    assert draft_fingerprint(draft(tmp_path / "one/mtp/"), False) == draft_fingerprint(
        draft(tmp_path / "one/mtp"), False
    )
    others = {
        draft_fingerprint(d, True)
        for d in [
            draft(tmp_path / "one/mtp", algorithm="NEXTN"),
            draft(tmp_path / "one/mtp", revision="r2"),
            draft(tmp_path / "one/mtp", quantization="fp8"),
            draft(tmp_path / "one/mtp", load_format="dummy"),
            draft(tmp_path / "one/mtp", own=True),
            draft("org/mtp"),
        ]
    }
    assert len(others) == 6 and one not in others
    # The target's own checkpoint (MTP layers bundled with it) is named, not read again.
    assert draft_fingerprint(draft("/a", own=True), True) == draft_fingerprint(
        draft("/b", own=True), True
    )
    ns = namespace_for(_config(), _page(draft_layers=1), StorageOptions(), draft=one)
    assert ns.extra.endswith(f";draft={one}")
    assert "draft=" not in namespace_for(_config(), _page(), StorageOptions()).extra


class MHATokenToKVPoolHost:
    """A stand-in with the attributes the page format reads, and SGLang's get_data_page for
    two layouts (the oracle the segments must agree with)."""

    def __init__(self, layout: str, page: int = 4, layers: int = 3, heads: int = 2, dim: int = 8):
        self.layout, self.page_size, self.layer_num = layout, page, layers
        self.head_num, self.head_dim, self.v_head_dim = heads, dim, dim
        self.dtype, self.size = torch.float16, 5 * page
        shape = (
            (2, layers, self.size, heads, dim)
            if layout == "layer_first"
            else (2, self.size, layers, heads, dim)
        )
        self.kv_buffer = (
            torch.arange(int(np.prod(shape)), dtype=torch.int16).view(torch.float16).reshape(shape)
        )

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * self.layer_num * self.page_size * self.head_num * self.head_dim)

    def get_data_page(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + self.page_size].flatten()
        return self.kv_buffer[:, index : index + self.page_size].flatten()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_segments_locate_sglangs_flat_page(layout: str) -> None:
    host = MHATokenToKVPoolHost(layout)
    fmt = describe_host_pool(host)
    assert (
        fmt.segments is not None and fmt.num_pages == 5 and fmt.page_bytes == 2 * 3 * 4 * 2 * 8 * 2
    )
    raw = host.kv_buffer.contiguous().view(torch.uint8).reshape(-1).numpy()
    for page in range(fmt.num_pages):
        got = b"".join(
            raw[
                s.offset + page * s.page_stride : s.offset + page * s.page_stride + s.chunk_bytes
            ].tobytes()
            for s in fmt.segments
        )
        want = host.get_data_page(page * 4).contiguous().view(torch.uint8).numpy().tobytes()
        assert got == want


def test_unlocatable_pools_are_staged_and_bad_pools_refused() -> None:
    host = MHATokenToKVPoolHost("page_first")
    host.layout = "page_unified"
    assert describe_host_pool(host).segments is None
    host = MHATokenToKVPoolHost("page_first")
    host.dtype = torch.complex64  # type: ignore[assignment]
    with pytest.raises(ValueError, match="complex64"):
        describe_host_pool(host)
    host = MHATokenToKVPoolHost("page_first")
    host.size = 21
    with pytest.raises(ValueError, match="whole number"):
        describe_host_pool(host)


def test_regression_a_symlinked_draft_folder_was_named_by_the_link(tmp_path: Path) -> None:
    """A local draft folder is named by its last component, so the same files at another
    path hit; a symlink to it (``/models/draft`` -> ``eagle-v2``) was named by the link,
    and an engine given the link shared no block with one given the folder. A trailing
    slash names the folder too."""
    folder = tmp_path / "eagle-v2"
    folder.mkdir()
    (folder / "model.bin").write_bytes(b"a" * 5000)
    (tmp_path / "draft").symlink_to(folder)

    def fingerprint(path: Path | str) -> str:
        draft = DraftModel("EAGLE", str(path), "", "auto", "", own=False)
        return draft_fingerprint(draft, True)

    assert fingerprint(tmp_path / "draft") == fingerprint(folder)
    assert fingerprint(f"{folder}/") == fingerprint(folder)
