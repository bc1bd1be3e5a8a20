"""GPUDirect Storage between L2's slot files and L0's slots, through kvikio. Optional.

Chosen once at start (``choose``): with ``tiers.l0.gds`` ``auto`` the path is used when
kvikio is installed, is not in its POSIX compatibility mode, and a probe transfer in the L2
directory round-trips bit-exact; otherwise L2 <-> L0 goes through pinned L1 as every other
transfer does. ``true`` makes a missing GDS an error at start; ``false`` never tries. The
choice and its reason are reported in stats.

Fail-closed reads: a block read into device memory cannot be checked with L2's host
checksum without copying it back, so a GDS transfer carries a ``block_digest`` computed on
the device (``kernels/digest.py``): ``write`` returns the digest of what it wrote, ``read``
verifies it and answers a miss on mismatch. Blocks that have only the host checksum (written
to L2 from L1) are read through pinned L1, never here.

Thread-safety: ``GdsFiles`` may be used from many threads; transfers are positional and
each file is opened once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.kernels.digest import block_digest
from kvtier.tiers.base import TierUnavailable

log = logging.getLogger(__name__)

PROBE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class GdsChoice:
    path: str  # "gds" or "pinned_l1"
    reason: str

    @property
    def active(self) -> bool:
        return self.path == "gds"


def choose(setting: str, directory: str | os.PathLike[str], device: torch.device) -> GdsChoice:
    """Decide the L2 <-> L0 path once, at start. Raises TierUnavailable when ``setting`` is
    ``true`` and GDS is not usable."""
    if setting == "false":
        return GdsChoice("pinned_l1", "disabled by tiers.l0.gds=false")
    reason = _unusable(directory, device)
    if reason is None:
        return GdsChoice("gds", "kvikio with GPUDirect Storage")
    if setting == "true":
        raise TierUnavailable(f"tiers.l0.gds=true, but GPUDirect Storage is not usable: {reason}")
    log.info("L2 <-> L0 through pinned L1: %s", reason)
    return GdsChoice("pinned_l1", reason)


def _unusable(directory: str | os.PathLike[str], device: torch.device) -> str | None:
    try:
        import kvikio
    except ImportError:
        return "kvikio is not installed (the cuda extra)"
    if device.type != "cuda":
        return "the GPU tier is not on a CUDA device"
    if _compat_mode(kvikio):
        return "kvikio runs in POSIX compatibility mode (no cuFile/GDS on this host)"
    try:
        _probe(directory, device)
    except Exception as e:  # any failure of the probe means: do not use the path
        return f"a probe transfer failed: {e}"
    return None


def _compat_mode(kvikio: Any) -> bool:
    defaults = kvikio.defaults
    if hasattr(defaults, "is_compat_mode_preferred"):
        return bool(defaults.is_compat_mode_preferred())
    return bool(defaults.compat_mode())  # kvikio < 24.12


def _probe(directory: str | os.PathLike[str], device: torch.device) -> None:
    path = Path(directory) / ".gds-probe"
    src = torch.randint(0, 256, (PROBE_BYTES,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    files = GdsFiles()
    try:
        files.write_raw(path, 0, src)
        files.read_raw(path, 0, dst)
        torch.cuda.synchronize(device)
        if not torch.equal(src, dst):
            raise OSError("the probe read back different bytes")
    finally:
        files.close()
        path.unlink(missing_ok=True)


class GdsFiles:
    """Positional transfers between files and device tensors (contiguous uint8)."""

    def __init__(self) -> None:
        import kvikio

        self._kvikio = kvikio
        self._files: dict[Path, Any] = {}
        self._lock = threading.Lock()

    def _file(self, path: Path) -> Any:
        with self._lock:
            f = self._files.get(path)
            if f is None:
                mode = "r+" if path.exists() else "w+"
                f = self._files[path] = self._kvikio.CuFile(path, mode)
            return f

    def read_raw(self, path: Path, offset: int, dest: torch.Tensor) -> None:
        n = self._file(path).pread(dest, dest.numel(), offset).get()
        if n != dest.numel():
            raise OSError(f"short read of {path} at {offset}: {n} of {dest.numel()} bytes")

    def write_raw(self, path: Path, offset: int, src: torch.Tensor) -> None:
        n = self._file(path).pwrite(src, src.numel(), offset).get()
        if n != src.numel():
            raise OSError(f"short write of {path} at {offset}: {n} of {src.numel()} bytes")

    def write(self, items: Sequence[tuple[Path, int, torch.Tensor]]) -> list[int | None]:
        """Write device blocks to ``(file, offset)``; per block its digest, or None when the
        write failed. Durability (fdatasync and the index) stays the disk tier's job."""
        futures = []
        for path, offset, src in items:
            try:
                futures.append(self._file(path).pwrite(src, src.numel(), offset))
            except Exception as e:
                log.error("GDS write to %s at %d failed: %s", path, offset, e)
                futures.append(None)
        out: list[int | None] = []
        for (_, _, src), fut in zip(items, futures, strict=True):
            ok = fut is not None and _done(fut, src.numel())
            out.append(block_digest(src[None])[0] if ok else None)
        return out

    def read(self, items: Sequence[tuple[Path, int, torch.Tensor, int]]) -> list[bool]:
        """Read ``(file, offset, device block, digest)``; False is a miss (I/O error, short
        read or a digest mismatch): the block's bytes must not be used."""
        futures = []
        for path, offset, dest, _ in items:
            try:
                futures.append(self._file(path).pread(dest, dest.numel(), offset))
            except Exception as e:
                log.error("GDS read of %s at %d failed: %s", path, offset, e)
                futures.append(None)
        out = []
        for (path, offset, dest, digest), fut in zip(items, futures, strict=True):
            ok = fut is not None and _done(fut, dest.numel())
            if ok and block_digest(dest[None])[0] != digest:
                log.error("GDS read of %s at %d: digest mismatch; a miss", path, offset)
                ok = False
            out.append(ok)
        return out

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def _done(future: Any, nbytes: int) -> bool:
    try:
        return int(future.get()) == nbytes
    except Exception as e:
        log.error("GDS transfer failed: %s", e)
        return False
