"""A cross-process CPU stand-in for CUDA IPC, for the engine-side GPU staging path
(``client/integrations/staging.py``'s ``CudaMemory``) against a real daemon process: the one
boundary that cannot exist without a GPU.

The engine's "GPU memory" is a file in /dev/shm whose "IPC handle" names it (``ShmGpuMemory``,
in the test process); the daemon, started by ``ENTRY``, opens handles through ``ShmMapper``
and runs its GPU tier on ``CpuOps``. Everything else on both sides is the real code: the
client's registration, the daemon's parsing and layout checks, its L0 <-> L1 copies, jobs.

``ShmGpuMemory`` also models the one thing a GPU adds, the engine's copies running later than
they are issued: every ``gather``/``scatter`` of the staging pool is an operation on a
"stream" that runs only when a mark after it is waited for, or when the test says the
device caught up (``run``). A page is *busy* while an
operation on it has not run; a daemon transfer that reads or writes a busy page is what
would be a race on a GPU (``busy_pages``, checked by the tests at each submission).
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.client.cuda import CudaIpcExport, IpcBuffer
from kvtier.client.integrations.staging import StagingMemory, StagingPool

PREFIX = b"kvtier-test-shm:"
UUID = b"\x22" * 16


def _handle(name: str) -> bytes:
    return (PREFIX + name.encode()).ljust(64, b"\0")


class ShmMapper:
    """``daemon.cuda_pools.IpcMapper`` over /dev/shm files (daemon side)."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}

    @property
    def device(self) -> int:
        return 0

    def device_uuid(self) -> bytes:
        return UUID

    def open(self, handle: bytes) -> tuple[int, int]:
        if not handle.startswith(PREFIX):
            raise OSError("cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (1)")
        name = handle[len(PREFIX) :].rstrip(b"\0").decode()
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        except OSError:
            raise OSError("cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (1)") from None
        try:
            size = os.fstat(fd).st_size
            m = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        t = torch.frombuffer(m, dtype=torch.uint8)
        self._maps[t.data_ptr()] = (m, t)
        return t.data_ptr(), size

    def close(self, base: int) -> None:
        self._maps.pop(base)  # the mapping goes with its last view

    def device_of(self, address: int) -> int:
        return 0

    def tensor(self, address: int, nbytes: int) -> torch.Tensor:
        for base, (_, t) in self._maps.items():
            if base <= address and address + nbytes <= base + t.numel():
                return t[address - base : address - base + nbytes]
        raise AssertionError("a view outside every mapped allocation")


# The daemon's entry: argv[1] is the folder of this module; then the daemon's arguments.
ENTRY = """
import sys
sys.path.insert(0, sys.argv.pop(1))
import kvtier.daemon.server as server
import kvtier.tiers.device as device
from kvtier.daemon.cuda_pools import CudaPoolOpener
from shm_ipc import ShmMapper

class CpuDeviceTier(device.DeviceTier):
    def __init__(self, capacity_bytes, segment_bytes, *, device=0, streams=2, ops=None):
        super().__init__(capacity_bytes, segment_bytes, streams=streams, ops=device_ops())

def device_ops():
    return device.CpuOps()

device.DeviceTier = CpuDeviceTier
server.open_opener = lambda enabled, dev: CudaPoolOpener(ShmMapper() if enabled else None, "off")
from kvtier.daemon.entry import main
sys.exit(main(sys.argv[1:]))
"""

DAEMON_SETTINGS = (
    "tiers.l0.enabled=true",
    "tiers.l0.capacity_bytes=16MiB",
    "tiers.l0.segment_bytes=1MiB",
)


@dataclass
class Mark:
    upto: int  # operations issued before it


class ShmGpuMemory(StagingMemory):
    """``StagingMemory`` standing in for ``CudaMemory`` (engine side); see the module."""

    def __init__(self, layout: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.name = f"kvtier-test-ipc-{os.getpid()}-{secrets.token_hex(6)}"
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        fd = os.open(f"/dev/shm/{self.name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=dtype).view(shape)
        self.export = CudaIpcExport((IpcBuffer(_handle(self.name), 0, nbytes, 0),), 0, UUID)
        self.export.check_layout(layout)
        self.ops: list[set[int]] = []  # pages each engine copy touches, in issue order
        self.ran = 0  # operations that have run
        self.released: list[bool] = []  # ``unclean`` of each release
        self.waiters: list[threading.Thread] = []  # the threads that waited for a mark

    def issue(self, pages: list[int]) -> None:
        self.ops.append(set(pages))

    def run(self) -> None:
        """The device catches up: every operation issued so far has run."""
        self.ran = len(self.ops)

    def busy_pages(self) -> set[int]:
        return set().union(*self.ops[self.ran :])

    def register(self, client: Any, layout: Any, namespace: Any) -> Any:
        try:
            return client.register_cuda_pool(self.export, layout, namespace)
        finally:
            os.unlink(f"/dev/shm/{self.name}")

    def mark(self) -> Mark:
        return Mark(len(self.ops))

    def passed(self, mark: object) -> bool:
        assert isinstance(mark, Mark)
        return mark.upto <= self.ran

    def wait(self, mark: object) -> None:
        assert isinstance(mark, Mark)
        self.waiters.append(threading.current_thread())
        self.ran = max(self.ran, mark.upto)

    def release(self, client: Any, pool: Any, unclean: bool) -> None:
        self.released.append(unclean)
        client.unregister_pool_nowait(pool.binding)
        del self.tensor


def use_shm_gpu_staging(monkeypatch: Any, made: list[ShmGpuMemory]) -> None:
    """Make every staging pool use ``ShmGpuMemory`` (appended to ``made``) and count its
    gathers and scatters as stream operations."""
    import kvtier.client.integrations.staging as staging

    def new_memory(layout, dtype, shape, device):  # type: ignore[no-untyped-def]
        memory = ShmGpuMemory(layout, dtype, shape)
        made.append(memory)
        return memory

    def on_stream(copy):  # type: ignore[no-untyped-def]
        def issued(self, layer, pages, tensor, blocks):  # type: ignore[no-untyped-def]
            copy(self, layer, pages, tensor, blocks)
            if isinstance(self.memory, ShmGpuMemory):
                self.memory.issue(list(pages))

        return issued

    monkeypatch.setattr(staging, "new_memory", new_memory)
    monkeypatch.setattr(StagingPool, "gather", on_stream(StagingPool.gather))
    monkeypatch.setattr(StagingPool, "scatter", on_stream(StagingPool.scatter))


def start_daemon(daemon_factory: Any, tmp_path: Any) -> Any:
    """A started daemon (``tests/harness.py``) run by ``ENTRY`` with ``DAEMON_SETTINGS``,
    stopped with the factory's daemons."""
    from harness import DaemonProcess

    d = DaemonProcess(
        tmp_path,
        f"{daemon_factory._sockdir}/gpu.sock",
        [arg for s in DAEMON_SETTINGS for arg in ("--set", s)],
        entry=("-c", ENTRY, os.path.dirname(os.path.abspath(__file__))),
    )
    daemon_factory._daemons.append(d)
    return d.start()
