"""The CUDA driver binding: on a host without the driver it says so; the handle and UUID
structures have the driver's sizes; on a GPU its calls agree with torch."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtier.kernels import cudadrv


@pytest.mark.no_cuda
def test_a_host_without_the_driver_gets_cuda_unavailable():
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.fail("this test describes a host without libcuda.so.1")
    cudadrv.driver.cache_clear()
    with pytest.raises(cudadrv.CudaUnavailable, match=r"libcuda\.so\.1"):
        cudadrv.driver()


def test_structures_have_the_drivers_sizes_and_keep_every_byte():
    assert ctypes.sizeof(cudadrv._IpcHandle) == cudadrv.IPC_HANDLE_BYTES == 64
    assert ctypes.sizeof(cudadrv._Uuid) == 16
    raw = bytes([0, 1, 0, 255] * 16)  # NULs inside must survive (a c_char array would cut)
    assert bytes(cudadrv._IpcHandle.from_buffer_copy(raw)) == raw


@pytest.mark.gpu
def test_the_driver_agrees_with_torch():
    drv = cudadrv.driver()
    t = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    inner = t[1 << 20 :]
    rng = drv.address_range(inner.data_ptr())
    assert rng.base <= t.data_ptr() and inner.data_ptr() + inner.numel() <= rng.base + rng.size
    assert drv.pointer_device(inner.data_ptr()) == torch.cuda.current_device()
    assert len(drv.ipc_get_handle(rng.base)) == 64
    # torch gives the UUID as a list of ints (torch 2.11), or bytes in other versions.
    assert drv.device_uuid(0) == bytes(torch.cuda.get_device_properties(0).uuid.bytes)
    with pytest.raises(cudadrv.CudaError):
        drv.ipc_open(b"\0" * 64)  # not a handle
