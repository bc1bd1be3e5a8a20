"""Stdout for one ``kvtier bench NAME --json`` run: the JSON object alone, everything else on
stderr.

Invariants, for the length of a ``JsonStdout`` block:

- file descriptor 1 is a copy of fd 2, and ``sys.stdout`` is ``sys.stderr``: the text report,
  child processes (a daemon, a redis-server, vLLM engines) and native libraries that write
  to fd 1 all write to stderr;
- ``emit`` writes exactly one JSON object, one line, to the stdout the caller had (a second
  call raises); ``fail`` writes ``{"ok": false, "error": ...}`` unless an object was already
  written.

On exit, whatever was buffered for fd 1 (Python's and C stdio's buffers) is flushed to stderr
before fd 1 is given back, so nothing written during the run reaches stdout after the object.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any

# The help of ``--json``, in ``kvtier bench --help`` and in each benchmark's own.
JSON_HELP = "stdout holds one JSON object of the figures, alone; the text report goes to stderr"

# What a benchmark's ``main`` is handed to print its figures with ``--json``.
Emit = Callable[[dict[str, Any]], None]


class JsonStdout:
    """The context of one ``--json`` run. Not thread-safe: one thread enters it, emits and
    exits; fd 1 is the process's, so one at a time per process."""

    def __init__(self) -> None:
        self._saved_fd = -1
        self._out: IO[str] | None = None
        self._owns_out = False
        self._redirect: contextlib.redirect_stdout[IO[str]] | None = None
        self.emitted = False

    def __enter__(self) -> JsonStdout:
        sys.stdout.flush()
        self._saved_fd = os.dup(1)  # not inheritable: children never see the real stdout
        if _backed_by_fd1(sys.stdout):
            self._out = open(self._saved_fd, "w", encoding="utf-8", closefd=False)
            self._owns_out = True
        else:
            # Replaced by an in-process caller (a test's capture, a redirect): the object
            # goes where that caller looks for it.
            self._out = sys.stdout
        os.dup2(2, 1)
        self._redirect = contextlib.redirect_stdout(sys.stderr)
        self._redirect.__enter__()
        return self

    def emit(self, figures: dict[str, Any]) -> None:
        if self.emitted:
            raise RuntimeError("a benchmark's JSON object was already written")
        assert self._out is not None, "emit() outside the with block"
        self._out.write(json.dumps(figures) + "\n")
        self._out.flush()
        self.emitted = True

    def fail(self, error: str) -> None:
        """The object of a run that ended without figures, unless it wrote them already."""
        if not self.emitted:
            self.emit({"ok": False, "error": error})

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._redirect is not None
        try:
            self._redirect.__exit__(exc_type, exc, tb)
            # The caller's stdout object again (the interpreter's, under `kvtier bench`):
            # what a library wrote to it straight, past the redirect, still goes to fd 2.
            sys.stdout.flush()
            _flush_c_stdio()
        finally:
            os.dup2(self._saved_fd, 1)
            if self._out is not None and self._owns_out:
                self._out.close()
            os.close(self._saved_fd)


def _backed_by_fd1(stream: IO[str]) -> bool:
    try:
        return stream.fileno() == 1
    except (AttributeError, OSError, ValueError):  # no file behind it, or closed
        return False


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: a native library's ``printf`` sits in C's stdout buffer (full
    buffering on a pipe) until flushed, and would land on the real stdout at exit."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)
