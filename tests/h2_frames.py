"""A bare HTTP/2 client for hostile tests: it opens gRPC calls and sends as much or as little
of their request as a test asks, which no gRPC client library lets it do (a request half sent
and never finished, for one). Headers are HPACK literals without indexing or Huffman coding;
only the frames such tests need are understood: SETTINGS, PING, WINDOW_UPDATE, RST_STREAM and
GOAWAY.
"""

from __future__ import annotations

import select
import socket
import struct
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS = 1, 1, 4
SETTINGS_INITIAL_WINDOW_SIZE = 4
MAX_FRAME = 16384


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _literal(name: bytes, value: bytes) -> bytes:
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def grpc_headers(path: str) -> bytes:
    return b"".join(
        _literal(k, v)
        for k, v in (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        )
    )


def grpc_prefix(message_bytes: int) -> bytes:
    """A gRPC message's 5-byte prefix: not compressed, ``message_bytes`` long."""
    return b"\x00" + message_bytes.to_bytes(4, "big")


class RawConnection:
    """One HTTP/2 connection to a Unix socket. Not thread-safe. ``initial_window``: the
    flow-control window this client grants the server on each of its streams (0: the server
    may send no message at all, as from a client that reads nothing)."""

    def __init__(self, socket_path: str, initial_window: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                self.sock.connect(socket_path)
                break
            except BlockingIOError:  # the listen backlog is full: the server is accepting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        settings = b""
        if initial_window is not None:
            settings = struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, initial_window)
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, settings))
        self._buffer = b""
        self._initial_window = 65535
        self.connection_window = 65535
        self.stream_windows: dict[int, int] = {}
        self.reset: set[int] = set()
        self.reset_codes: dict[int, int] = {}  # stream -> the server's RST_STREAM error code
        self.closed = False
        self._next_stream = 1

    def open_call(self, path: str) -> int:
        stream = self._next_stream
        self._next_stream += 2
        self.sock.sendall(frame(HEADERS, END_HEADERS, stream, grpc_headers(path)))
        self.stream_windows[stream] = self._initial_window
        return stream

    def send(self, stream: int, data: bytes, end: bool = False) -> int:
        """Sends what the flow-control windows allow of ``data``; returns how much."""
        sent = 0
        while sent < len(data):
            self.pump(0.0)
            room = min(self.connection_window, self.stream_windows.get(stream, 0), MAX_FRAME)
            n = min(room, len(data) - sent)
            if n <= 0:
                break
            sent += n
            last = end and sent == len(data)
            self.sock.sendall(frame(DATA, END_STREAM if last else 0, stream, data[sent - n : sent]))
            self.connection_window -= n
            self.stream_windows[stream] -= n
        return sent

    def pump(self, timeout_s: float) -> None:
        """Reads and handles what the server sent, waiting up to ``timeout_s`` for the first."""
        while not self.closed:
            ready, _, _ = select.select([self.sock], [], [], timeout_s)
            if not ready:
                return
            timeout_s = 0.0
            try:
                data = self.sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                self.closed = True
                return
            self._buffer += data
            self._frames()

    def _frames(self) -> None:
        while len(self._buffer) >= 9:
            length = int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < 9 + length:
                return
            kind, flags = self._buffer[3], self._buffer[4]
            stream = int.from_bytes(self._buffer[5:9], "big") & 0x7FFFFFFF
            payload = self._buffer[9 : 9 + length]
            self._buffer = self._buffer[9 + length :]
            if kind == SETTINGS and not flags & ACK:
                for i in range(0, len(payload), 6):
                    key, value = struct.unpack(">HI", payload[i : i + 6])
                    if key == SETTINGS_INITIAL_WINDOW_SIZE:
                        for s in self.stream_windows:
                            self.stream_windows[s] += value - self._initial_window
                        self._initial_window = value
                self.sock.sendall(frame(SETTINGS, ACK, 0))
            elif kind == WINDOW_UPDATE:
                increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
                if stream == 0:
                    self.connection_window += increment
                elif stream in self.stream_windows:
                    self.stream_windows[stream] += increment
            elif kind == PING and not flags & ACK:
                self.sock.sendall(frame(PING, ACK, 0, payload))
            elif kind == RST_STREAM or (kind == HEADERS and flags & END_STREAM):
                if kind == RST_STREAM:
                    self.reset_codes[stream] = int.from_bytes(payload[:4], "big")
                self.reset.add(stream)
                self.stream_windows.pop(stream, None)
            elif kind == GOAWAY:
                self.closed = True

    def close(self) -> None:
        self.sock.close()
