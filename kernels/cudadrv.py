"""The few CUDA driver calls CUDA IPC needs, through ctypes on ``libcuda.so.1``.

torch has no public call that exports or opens a raw ``cudaIpcMemHandle_t`` or that tells
which allocation a pointer lies in, and the validation of a registration needs exactly that:
the real size of the allocation behind a handle, and the device it lives on. So both sides
(the client that exports handles from an engine's tensors, the daemon that opens them) use
this module, and nothing else in kvtier speaks to the driver.

Every call runs in the calling thread's current context: torch makes the device's primary
context current when it first touches the device (``torch.cuda.set_device``), and the
pointers opened here are then ordinary device pointers of that context, usable by torch.

The one library is loaded on first use; a host without the driver gets ``CudaUnavailable``
with the reason. A failing call raises ``CudaError`` with the driver's name for the code.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
_UUID_BYTES = 16


class CudaUnavailable(RuntimeError):
    """No CUDA driver on this host (or it cannot be loaded)."""


class CudaError(RuntimeError):
    """A driver call failed; ``code`` is the CUresult, ``name`` its enum name."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code
        self.name = name


# Byte arrays as c_ubyte: a c_char array field reads back as bytes cut at the first NUL.
class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * _UUID_BYTES)]


@dataclass(frozen=True, slots=True)
class AddressRange:
    base: int
    size: int


class Driver:
    """Thin wrappers; each returns plain Python values. Thread-safety: the driver's."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        u64, p = ctypes.c_uint64, ctypes.POINTER
        self._fn("cuInit", [ctypes.c_uint])
        self._fn("cuGetErrorName", [ctypes.c_int, p(ctypes.c_char_p)])
        self._fn("cuIpcGetMemHandle", [p(_IpcHandle), u64])
        self._fn("cuIpcOpenMemHandle_v2", [p(u64), _IpcHandle, ctypes.c_uint])
        self._fn("cuIpcCloseMemHandle", [u64])
        self._fn("cuMemGetAddressRange_v2", [p(u64), p(ctypes.c_size_t), u64])
        self._fn("cuPointerGetAttribute", [ctypes.c_void_p, ctypes.c_int, u64])
        self._fn("cuDeviceGet", [p(ctypes.c_int), ctypes.c_int])
        self._fn("cuDeviceGetUuid_v2", [p(_Uuid), ctypes.c_int])
        self._check("cuInit", self._lib.cuInit(0))

    def _fn(self, name: str, argtypes: list[object]) -> None:
        # Versioned entry points (``_v2``) are what cuda.h maps the plain names to; a
        # driver too old for them still exports the plain name with the same signature.
        f = getattr(self._lib, name, None)
        if f is None and name.endswith("_v2"):
            f = getattr(self._lib, name[:-3])
            setattr(self._lib, name, f)
        if f is None:
            raise AttributeError(name)
        f.argtypes = argtypes
        f.restype = ctypes.c_int

    def _check(self, call: str, code: int) -> None:
        if code == 0:
            return
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            raise CudaError(call, code, name.value.decode())
        raise CudaError(call, code, "CUDA_ERROR_UNKNOWN")

    def ipc_get_handle(self, ptr: int) -> bytes:
        """The IPC handle of the allocation that contains ``ptr`` (it names the whole
        allocation: pair it with ``address_range(ptr)`` to say where ``ptr`` lies in it)."""
        h = _IpcHandle()
        self._check("cuIpcGetMemHandle", self._lib.cuIpcGetMemHandle(ctypes.byref(h), ptr))
        return bytes(h)

    def ipc_open(self, handle: bytes) -> int:
        """Map another process's allocation; returns its base address in this process."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        h = _IpcHandle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        self._check(
            "cuIpcOpenMemHandle",
            self._lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS),
        )
        return int(ptr.value)

    def ipc_close(self, ptr: int) -> None:
        self._check("cuIpcCloseMemHandle", self._lib.cuIpcCloseMemHandle(ptr))

    def address_range(self, ptr: int) -> AddressRange:
        """The allocation that contains ``ptr``."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(
            "cuMemGetAddressRange",
            self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
        )
        return AddressRange(int(base.value), int(size.value))

    def pointer_device(self, ptr: int) -> int:
        """The ordinal (in this process's numbering) of the device holding ``ptr``."""
        out = ctypes.c_int()
        self._check(
            "cuPointerGetAttribute",
            self._lib.cuPointerGetAttribute(
                ctypes.byref(out), _POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr
            ),
        )
        return int(out.value)

    def device_uuid(self, ordinal: int) -> bytes:
        """The device's UUID: the same in every process, whatever CUDA_VISIBLE_DEVICES says."""
        dev = ctypes.c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(dev), ordinal))
        uuid = _Uuid()
        self._check("cuDeviceGetUuid", self._lib.cuDeviceGetUuid_v2(ctypes.byref(uuid), dev))
        return bytes(uuid)


@functools.cache
def driver() -> Driver:
    """The process's driver binding. Raises CudaUnavailable without a usable driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaUnavailable(f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from None
    try:
        return Driver(lib)
    except CudaError as e:
        raise CudaUnavailable(f"the CUDA driver does not start: {e}") from None
    except AttributeError as e:
        raise CudaUnavailable(f"the CUDA driver is too old: {e}") from None
