"""Shared-memory pools: host memory the engine and the daemon both map.

The client creates the region (so it owns its lifetime and permissions), fills it with KV
pages, and registers it once; afterwards requests name pages by index and the daemon copies
bytes in and out of the region directly.

Two backings:
- ``memfd`` (the default): an anonymous memory file. It has no name anywhere, so a process
  killed at any moment leaves nothing behind; the client hands its descriptor to the daemon
  over the credential socket. It is sealed against shrinking and growing, so neither this
  process nor anything it hands the descriptor to can truncate it under a copy.
- ``shm``: a named POSIX shared-memory object in ``/dev/shm`` (for clients that need a
  name). The daemon opens it by name, only if it belongs to the registering process's uid.
  A killed process leaves the name behind; ``close()`` in the process that made the pool
  removes it (in a child that process forked, it leaves the name to the parent).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import stat
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from kvtier.client.errors import InvalidArgumentError
from kvtier.client.types import checked_int, checked_type, shown
from kvtier.kernels.layout import PoolLayout

if TYPE_CHECKING:
    import torch

DEFAULT_SHM_DIR = "/dev/shm"
BACKINGS = ("memfd", "shm")
# The largest file size ftruncate takes (an off_t): a larger size raised OverflowError.
MAX_SIZE_BYTES = 2**63 - 1
# Linux's limit on a memfd's name: with its "memfd:" prefix, one file name (255 bytes).
MAX_MEMFD_NAME_BYTES = 249
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _check_name_fits(name: str, folder: str | os.PathLike[str]) -> None:
    """Refuse a shared-memory object's name longer than a file name in ``folder`` may be
    (its NAME_MAX, 255 bytes where the system does not say), which ``os.open`` refused
    with a bare OSError (ENAMETOOLONG)."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):  # no such folder (os.open says so), or no such name
        limit = 255
    if 0 < limit < (size := len(os.fsencode(name))):
        raise InvalidArgumentError(
            f"name: a file name in {os.fspath(folder)} holds at most {limit} bytes (its "
            f"NAME_MAX), this one {size}"
        )


class SharedMemoryPool:
    """A shared memory region of ``size_bytes``, created fresh and pre-faulted.

    ``backing`` is ``"memfd"`` (the default unless a ``name`` is given) or ``"shm"``; ``name``
    is the /dev/shm object's name (random if None; one file name, at most its folder's
    NAME_MAX bytes) or the memfd's label (at most ``MAX_MEMFD_NAME_BYTES``). ``seal=False``
    leaves a memfd resizable. An argument of the wrong type or out of range is
    ``InvalidArgumentError`` (a ValueError) naming it. The memory lives until every mapping
    (the daemon's included) is gone. Once ``close()`` ran, ``array()``, ``tensor()`` and
    registering the pool (again,
    after a daemon restart, too) raise ``InvalidArgumentError`` (a ValueError) naming the
    pool, even where earlier views keep the mapping alive; pages already registered stay
    the daemon's to copy until the pool is unregistered. Thread-safety: the memory may be
    used from any thread, and so may ``close()``: a registration on another thread hands
    the daemon a descriptor of its own (``descriptor``), which ``close()`` cannot close
    under it.
    """

    def __init__(
        self,
        size_bytes: int,
        *,
        name: str | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
        mode: int = 0o600,
        backing: str | None = None,
        seal: bool = True,
    ) -> None:
        size_bytes = checked_int(size_bytes, "size_bytes", minimum=1)
        if size_bytes > MAX_SIZE_BYTES:
            raise InvalidArgumentError(
                f"size_bytes: {shown(size_bytes)} is more than a memory file holds "
                f"({MAX_SIZE_BYTES} bytes)"
            )
        if name is not None:
            checked_type(name, str, "name")
            if "\0" in name:
                raise InvalidArgumentError(f"name: {name!r} holds a NUL character")
        if backing is not None and (not isinstance(backing, str) or backing not in BACKINGS):
            raise InvalidArgumentError(f"backing: must be one of {BACKINGS}, not {shown(backing)}")
        if not isinstance(seal, (bool, np.bool_)):
            raise InvalidArgumentError(f"seal: expected bool, not {type(seal).__name__}")
        if not 0 <= (mode := checked_int(mode, "mode")) <= 0o7777:
            raise InvalidArgumentError(
                f"mode: must be a file mode, 0 to 0o7777 (got {shown(mode)})"
            )
        backing = backing or ("shm" if name else "memfd")
        if backing == "shm":
            checked_type(shm_dir, (str, os.PathLike), "shm_dir")
            if name is not None and "/" in name:
                raise InvalidArgumentError(
                    f"name: {name!r} holds a '/': a shared-memory object's name is one file name"
                )
            if name is not None:
                _check_name_fits(name, shm_dir)
        elif name is not None and (size := len(os.fsencode(name))) > MAX_MEMFD_NAME_BYTES:
            # memfd_create failed with a bare OSError (EINVAL) naming nothing.
            raise InvalidArgumentError(
                f"name: a memfd's name holds at most {MAX_MEMFD_NAME_BYTES} bytes, this one {size}"
            )
        self.backing = backing
        self.name = name or f"kvtier-{os.getpid()}-{secrets.token_hex(6)}"
        self.size_bytes = size_bytes
        self.path: str | None = None
        self.fd = -1
        self.sealed = False
        self._close_lock = threading.Lock()
        if backing == "shm":
            self.path = os.path.join(shm_dir, self.name)
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, mode)
        else:
            fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size_bytes)
            # Allocate every page now: a tmpfs that is too small fails here, not mid-copy.
            os.posix_fallocate(fd, 0, size_bytes)
            if backing == "memfd" and seal:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
                self.sealed = True
            self.buffer = mmap.mmap(
                fd, size_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
            self._mapped = True
        except BaseException:
            os.close(fd)
            if self.path is not None:
                os.unlink(self.path)
            raise
        self._finalizer: weakref.finalize[..., SharedMemoryPool]
        if self.path is not None:
            os.close(fd)
            self._finalizer = weakref.finalize(self, _unlink_quietly, self.path, os.getpid())
        else:
            self.fd = fd  # kept: registering again (after a daemon restart) hands it over again
            self._finalizer = weakref.finalize(self, _close_quietly, fd)

    @classmethod
    def for_layout(cls, layout: PoolLayout, **kwargs: object) -> SharedMemoryPool:
        """A pool just large enough for ``layout``."""
        return cls(layout.extent_bytes, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def from_fd(cls, fd: int, *, label: str = "adopted") -> SharedMemoryPool:
        """Memory another component created as a memory file (a memfd, or an unlinked tmpfs
        file), wrapped so that it can be registered: e.g. an engine's own host KV pool.

        The pool keeps its own duplicate of ``fd`` (registering hands it to the daemon;
        ``close()`` closes only the duplicate) and its own mapping of the whole file. It is
        ``sealed`` only if the creator sealed it against shrinking; if not, the creator can
        truncate it under a copy, which the daemon survives by marking the pool broken.

        The daemon registers it only if its memory is allocated in full (posix_fallocate, or
        every page written; else FAILED_PRECONDITION): pages the daemon's copies allocated
        in its holes would be charged to the daemon's memory, not to their owner's. Nothing
        is checked here: the creator may allocate it after wrapping it."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
            raise ValueError(f"descriptor {fd} is not a non-empty memory file")
        self = cls.__new__(cls)
        self.backing = "memfd"
        self.name = label
        self.size_bytes = st.st_size
        self.path = None
        self.sealed = _sealed(fd)
        self._close_lock = threading.Lock()
        dup = os.dup(fd)
        try:
            os.set_inheritable(dup, False)
            self.buffer = mmap.mmap(dup, st.st_size, flags=mmap.MAP_SHARED)
            self._mapped = True
        except BaseException:
            os.close(dup)
            raise
        self.fd = dup
        self._finalizer = weakref.finalize(self, _close_quietly, dup)
        return self

    @property
    def closed(self) -> bool:
        """Whether ``close()`` (or, for a named object, ``unlink()``) ran: the memory can no
        longer be registered (its descriptor or its name is gone)."""
        return not self._finalizer.alive

    def closed_error(self) -> InvalidArgumentError:
        """What using the pool after ``close()`` (or registering a named one after
        ``unlink()``) raises: the mapping's own ValueError ("mmap closed or invalid") or
        torch's RuntimeError named nothing, and a registration sent the daemon a name that
        was gone (NotFoundError for a memory file, which has none)."""
        gone = "closed" if not self._mapped else "unlinked (its name is gone)"
        return InvalidArgumentError(f"shm: the pool {self.name!r} was {gone}")

    @contextlib.contextmanager
    def descriptor(self) -> Iterator[int]:
        """A duplicate of the memory file's descriptor, open for the ``with`` block: what
        registering hands to the daemon. Taken under the lock ``close()`` takes, so a
        ``close()`` on another thread can neither close it under the hand-over (which then
        failed with EBADF) nor free its number for another file to take (which then went to
        the daemon instead). Raises ``closed_error()`` once ``close()`` ran. The duplicate is
        taken inside the ``try`` that closes it: an interrupt (KeyboardInterrupt) as the
        lock was let go left it open for the process's life."""
        fd = -1
        try:
            with self._close_lock:
                if self.closed:
                    raise self.closed_error()
                fd = os.dup(self.fd)
            yield fd
        finally:
            if fd >= 0:
                os.close(fd)

    def _mapping(self) -> mmap.mmap:
        if not self._mapped:
            raise self.closed_error()
        return self.buffer

    def array(self) -> np.ndarray:
        """The whole region as a uint8 numpy array (shares memory). Raises
        ``InvalidArgumentError`` once the pool is closed."""
        return np.frombuffer(self._mapping(), dtype=np.uint8)

    def tensor(
        self,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        """A torch tensor view of the region from ``offset`` (shares memory). Raises
        ``InvalidArgumentError`` once the pool is closed."""
        buffer = self._mapping()
        import torch

        dtype = dtype or torch.uint8
        itemsize = torch.empty(0, dtype=dtype).element_size()
        count = (self.size_bytes - offset) // itemsize
        if shape is not None:
            count = int(np.prod(shape))
        t = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
        return t.view(shape) if shape is not None else t

    def unlink(self) -> None:
        """Remove a named object's name now; mappings (the daemon's included) stay valid.
        A memfd has no name: this does nothing; nor does it in a forked child (see
        ``_unlink_quietly``)."""
        if self.path is not None:
            self._finalizer()

    def close(self) -> None:
        """Unmap the memory (once no view holds it) and close the descriptor, or remove a
        named object's name. Idempotent."""
        with self._close_lock:
            self._finalizer()  # removes the name, or closes the memfd's descriptor
            self.fd = -1
        self._mapped = False
        # Views (tensors, arrays) may still exist; then the mapping goes when they do.
        with contextlib.suppress(BufferError):
            self.buffer.close()

    def __enter__(self) -> SharedMemoryPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink_quietly(path: str, creator: int) -> None:
    """Remove a named object's name, in the process ``creator`` that made it only: a child
    it forked that closed its copy (a ``with`` block the child left, or its exit's
    finalizers) removed the name the parent still used, so that registering it again
    (after a daemon restart) failed."""
    if os.getpid() != creator:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _sealed(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        return False


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
