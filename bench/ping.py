"""A bare gRPC ping server: the floor any unary call over a Unix socket pays.

One unary echo method (``PING_METHOD``) on a ``grpc.aio`` server, with the daemon's keepalive
settings and nothing else. ``kvtier bench rpc`` runs it in a spawned process;
``kvtier bench instructions`` runs ``python -m kvtier.bench.ping PATH LOOP`` under callgrind.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

PING_METHOD = "/kvtier.bench.Ping/Echo"


def serve(path: str, loop: str, on_ready: Callable[[], None] = lambda: None) -> None:
    """Serve the echo method on the Unix socket ``path`` on the event loop ``loop`` ('asyncio'
    or 'uvloop') until the process is stopped; ``on_ready`` is called once it listens."""
    import grpc

    from kvtier.daemon import loops
    from kvtier.paths import unix_address

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def main() -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ]
        )
        handler = grpc.method_handlers_generic_handler(
            "kvtier.bench.Ping", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
        )
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(unix_address(path))  # as gRPC reads it back: the path
        await server.start()
        on_ready()
        await server.wait_for_termination()

    loops.run(main(), loop)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
