"""A CPU stand-in for the CUDA calls of IPC pools (``daemon.cuda_pools.IpcMapper``): the one
boundary that cannot exist without a GPU. "Allocations" are CPU tensors named by 64-byte
handles; everything above the boundary (parsing, validation, handle sharing, lifetimes,
copies) is the daemon's real code."""

from __future__ import annotations

import os

import torch


class CpuMapper:
    def __init__(self, device: int = 0, uuid: bytes = b"\x11" * 16) -> None:
        self._device = device
        self._uuid = uuid
        self.allocations: dict[bytes, torch.Tensor] = {}
        self.device_of_allocation: dict[int, int] = {}
        self.mapped: dict[int, bytes] = {}  # base -> handle, while open
        self.opens = 0

    def allocate(self, nbytes: int, device: int | None = None) -> tuple[bytes, torch.Tensor]:
        handle = os.urandom(64)
        t = torch.zeros(nbytes, dtype=torch.uint8)
        self.allocations[handle] = t
        self.device_of_allocation[t.data_ptr()] = self._device if device is None else device
        return handle, t

    def adopt(self, t: torch.Tensor) -> bytes:
        """Make an existing tensor's bytes an allocation (no copy): what an engine exports."""
        handle = os.urandom(64)
        flat = t.view(-1).view(torch.uint8)
        self.allocations[handle] = flat
        self.device_of_allocation[flat.data_ptr()] = self._device
        return handle

    def forget(self, handle: bytes) -> None:
        """The exporting process freed the allocation: its handle is stale."""
        del self.allocations[handle]

    @property
    def device(self) -> int:
        return self._device

    def device_uuid(self) -> bytes:
        return self._uuid

    def open(self, handle: bytes) -> tuple[int, int]:
        t = self.allocations.get(handle)
        if t is None:
            raise OSError("cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (1)")
        if t.data_ptr() in self.mapped:
            raise AssertionError("an allocation was opened twice")
        self.opens += 1
        self.mapped[t.data_ptr()] = handle
        return t.data_ptr(), t.numel()

    def close(self, base: int) -> None:
        del self.mapped[base]

    def device_of(self, address: int) -> int:
        return self.device_of_allocation[address]

    def tensor(self, address: int, nbytes: int) -> torch.Tensor:
        for base, handle in self.mapped.items():
            t = self.allocations[handle]
            if base <= address and address + nbytes <= base + t.numel():
                return t[address - base : address - base + nbytes]
        raise AssertionError("a view outside every mapped allocation")
