"""GPUDirect Storage is chosen once at start and never required; on a GPU with kvikio its
transfers are verified with the device digest."""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.tiers.base import TierUnavailable
from kvtier.tiers.gds import GdsFiles, choose


def test_off_when_disabled(tmp_path):
    c = choose("false", tmp_path, torch.device("cpu"))
    assert (c.path, c.active) == ("pinned_l1", False)
    assert "tiers.l0.gds=false" in c.reason


def test_auto_falls_back_to_pinned_l1_with_the_reason(tmp_path):
    c = choose("auto", tmp_path, torch.device("cpu"))
    assert c.path == "pinned_l1"
    try:
        import kvikio  # noqa: F401

        assert "CUDA device" in c.reason
    except ImportError:
        assert "kvikio is not installed" in c.reason


def test_required_but_unusable_is_an_error_at_start(tmp_path):
    with pytest.raises(TierUnavailable, match=r"tiers\.l0\.gds=true"):
        choose("true", tmp_path, torch.device("cpu"))


@pytest.mark.gpu
def test_device_blocks_round_trip_through_files_and_corruption_is_a_miss(tmp_path):
    pytest.importorskip("kvikio", reason="the cuda extra (kvikio) is not installed")
    files = GdsFiles()
    path = tmp_path / "data"
    with open(path, "wb") as f:
        f.truncate(8 << 20)
    blocks = torch.randint(0, 256, (3, 2 << 20), dtype=torch.uint8, device="cuda")
    digests = files.write([(path, j * (2 << 20), blocks[j]) for j in range(3)])
    assert all(d is not None for d in digests)
    out = torch.zeros_like(blocks)
    ok = files.read([(path, j * (2 << 20), out[j], digests[j]) for j in range(3)])
    assert ok == [True, True, True] and torch.equal(out, blocks)
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, b"\x00" * 4096, (2 << 20) + 8192)  # a page of block 1 lost
    os.close(fd)
    files.close()  # drop cached handles so the read sees the file as it is now
    files = GdsFiles()
    ok = files.read([(path, j * (2 << 20), out[j], digests[j]) for j in range(3)])
    assert ok == [True, False, True]
    files.close()
    print("GDS choice on this host:", choose("auto", tmp_path, torch.device("cuda", 0)))
