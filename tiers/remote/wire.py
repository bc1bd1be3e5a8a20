"""Sending a framed value without first copying it into one buffer.

A stored value is a 32-byte header followed by the block's bytes (``codec``). The bytes live
in the caller's buffer (an L1 slot); joining header and bytes into one contiguous value costs
a full copy of the block before redis-py copies it again into its send buffer. Instead, a
``Framed`` argument goes out as two chunks of one RESP bulk string (``$<len>\\r\\n``, the
header, the bytes, ``\\r\\n``): on the wire it is the same value.

redis-py packs commands in its connection class (``pack_command``; pipelines go through it
too). ``use_framed_packing`` gives a client's connections a subclass that knows ``Framed``;
every other argument is packed by redis-py itself. The client's internals it relies on are
checked when it is installed (``FramedPackingUnavailable``), never guessed at on the wire.

Thread-safety: ``Framed`` is immutable; ``use_framed_packing`` is called once per client,
before its first command.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection


class FramedPackingUnavailable(RuntimeError):
    """This redis-py does not expose what ``use_framed_packing`` replaces."""


class Framed:
    """A value sent as ``header`` then ``body`` (a byte memoryview), without joining them.
    The body's buffer must stay unchanged until the command has been sent."""

    __slots__ = ("body", "header")

    def __init__(self, header: bytes, body: memoryview) -> None:
        self.header = header
        self.body = body

    def __len__(self) -> int:
        return len(self.header) + len(self.body)


class _FramedPacking:
    """Connection mixin: packs a command holding a ``Framed`` argument itself; any other
    command is redis-py's."""

    encoder: Any

    def pack_command(self, *args: Any) -> list[bytes | memoryview]:
        if not any(type(a) is Framed for a in args):
            return super().pack_command(*args)  # type: ignore[misc, no-any-return]
        out: list[bytes | memoryview] = []
        head = b"*%d\r\n" % len(args)
        for arg in args:
            if type(arg) is Framed:
                # The body goes out as its own chunk: pack_commands passes memoryviews
                # through instead of joining them with their neighbours.
                out.append(head + b"$%d\r\n" % len(arg) + arg.header)
                out.append(arg.body)
                head = b"\r\n"
            else:
                data = self.encoder.encode(arg)
                head += b"$%d\r\n" % len(data) + bytes(data) + b"\r\n"
        out.append(head)
        return out


_CLASSES: dict[type, type] = {}


def _framed_class(base: type) -> type:
    if not issubclass(base, Connection):
        raise FramedPackingUnavailable(f"unexpected connection class {base!r}")
    if issubclass(base, _FramedPacking):
        return base
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(f"Framed{base.__name__}", (_FramedPacking, base), {})
        _CLASSES[base] = cls
    return cls


def use_framed_packing(client: Any) -> None:
    """Make every connection ``client`` (a ``redis.asyncio.Redis`` or ``RedisCluster`` not
    yet used) opens pack ``Framed`` arguments."""
    if isinstance(client, RedisCluster):
        manager = getattr(client, "nodes_manager", None)
        kwargs = getattr(manager, "connection_kwargs", None)
        nodes = getattr(manager, "startup_nodes", None)
        if not isinstance(kwargs, dict) or not isinstance(nodes, dict):
            raise FramedPackingUnavailable("RedisCluster without nodes_manager.connection_kwargs")
        # Nodes found later are built from these kwargs; the startup nodes exist already.
        kwargs["connection_class"] = _framed_class(kwargs.get("connection_class", Connection))
        for node in nodes.values():
            node.connection_class = _framed_class(node.connection_class)
        return
    pool = getattr(client, "connection_pool", None)
    if pool is None or not hasattr(pool, "connection_class"):
        raise FramedPackingUnavailable("client without connection_pool.connection_class")
    pool.connection_class = _framed_class(pool.connection_class)
