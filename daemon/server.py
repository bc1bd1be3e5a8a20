"""The gRPC front: a thin servicer over KVService, and the server's lifecycle.

The servicer only translates protobuf to domain calls and back; errors become status codes in
exactly one place (``_rpc``). The server runs on one asyncio event loop; copies run on a small
thread pool while the loop keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvtier.client.types import DTYPE_NAMES
from kvtier.daemon import systemd
from kvtier.daemon.config import Config
from kvtier.daemon.errors import InvalidArgument, KvtierError
from kvtier.daemon.pools import PoolRegistry
from kvtier.daemon.service import KVService
from kvtier.daemon.sessions import SessionRegistry
from kvtier.daemon.store import BlockStore
from kvtier.kernels.layout import LayerLayout, PoolLayout
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "kvtier.v1.KVTier"
R = TypeVar("R")


def _rpc(
    fn: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]],
) -> Callable[..., Awaitable[R]]:
    """Map domain errors to their status, and anything unexpected to INTERNAL with a log."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await fn(self, request, context)
        except KvtierError as e:
            await context.abort(e.code, str(e))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            log.exception("%s failed", fn.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"{fn.__name__} failed inside the daemon; see its log"
            )
        raise AssertionError("unreachable")

    return wrapper


def layout_from_pb(msg: pb.PoolLayout) -> PoolLayout:
    if msg.dtype not in DTYPE_NAMES:
        raise InvalidArgument("layout.dtype is unspecified or unknown")
    layers = tuple(
        LayerLayout(x.offset, x.kv_count, x.kv_stride, x.page_stride, x.chunk_bytes)
        for x in msg.layers
    )
    return PoolLayout(layers, msg.num_pages, msg.block_tokens, DTYPE_NAMES[msg.dtype])


class KVTierServicer(pb_grpc.KVTierServicer):
    def __init__(self, service: KVService, ping_interval_s: int) -> None:
        self.service = service
        self.ping_interval_s = ping_interval_s
        # Set at shutdown: session streams end, so draining waits only for real requests.
        self.closing = asyncio.Event()

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionEvent]:
        session = self.service.open_session(request.client_name)
        try:
            event = pb.SessionEvent(
                session_id=session.session_id, ping_interval_s=self.ping_interval_s
            )
            while not self.closing.is_set():
                yield event
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.closing.wait(), self.ping_interval_s)
        finally:
            self.service.close_session(session.session_id)

    @_rpc
    async def RegisterPool(
        self, request: pb.RegisterPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterPoolResponse:
        region = request.WhichOneof("region")
        if region == "shm":
            layout = layout_from_pb(request.layout)
            pool = self.service.register_shm_pool(
                request.session_id, request.shm.name, request.shm.size_bytes, layout
            )
        elif region == "cuda_ipc":
            pool = self.service.register_cuda_ipc_pool(request.session_id)
        else:
            raise InvalidArgument("RegisterPool needs a region: shm or cuda_ipc")
        return pb.RegisterPoolResponse(pool_id=pool.pool_id, block_bytes=pool.block_bytes)

    @_rpc
    async def UnregisterPool(
        self, request: pb.UnregisterPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterPoolResponse:
        self.service.unregister_pool(request.session_id, request.pool_id)
        return pb.UnregisterPoolResponse()

    @_rpc
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        out = self.service.lookup(request.session_id, request.keys, request.pin, request.lease_ms)
        return pb.LookupResponse(
            prefix_len=out.prefix_len, tiers=out.tiers.tolist(), lease_id=out.lease_id
        )

    @_rpc
    async def Put(
        self, request: pb.PutRequest, context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        results, persisted = await self.service.put(
            request.session_id,
            request.pool_id,
            request.keys,
            request.pages,
            request.parent_key,
            request.durable,
        )
        return pb.PutResponse(
            results=results.tolist(),
            stored=int((results == pb.PUT_STORED).sum()),
            persisted=persisted.tolist() if persisted is not None else [],
        )

    @_rpc
    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetResponse:
        loaded = await self.service.get(
            request.session_id,
            request.pool_id,
            request.keys,
            request.pages,
            request.lease_id,
            request.layer_begin,
            request.layer_end,
        )
        prefix = int(loaded.argmin()) if not loaded.all() else len(loaded)
        return pb.GetResponse(loaded=loaded.tolist(), prefix_len=prefix)

    @_rpc
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        self.service.release(request.session_id, request.lease_id)
        return pb.ReleaseResponse()

    @_rpc
    async def Prefetch(
        self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefetchResponse:
        out = self.service.prefetch(
            request.session_id, request.keys, request.deadline_ms, request.priority
        )
        return pb.PrefetchResponse(
            resident=out.resident, scheduled=out.scheduled, missing=out.missing
        )

    @_rpc
    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteResponse:
        out = await self.service.delete(request.session_id, request.keys)
        return pb.DeleteResponse(deleted=out.deleted, missing=out.missing, busy=out.busy)

    @_rpc
    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        snap = self.service.stats()
        return pb.StatsResponse(
            tiers=[
                pb.TierStats(
                    tier=int(u.kind),
                    capacity_bytes=u.capacity_bytes,
                    used_bytes=u.used_bytes,
                    blocks=u.blocks,
                    state=u.state,
                )
                for u in snap.tiers
            ],
            counters=snap.counters,
            gauges=snap.gauges,
            uptime_s=snap.uptime_s,
            version=snap.version,
        )


class Daemon:
    """One running kvtierd: store, service, gRPC server and background tasks."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvtier-io")
        self.store = BlockStore(config, self.executor)
        self.pools = PoolRegistry(config.server.shm_dir)
        self.sessions = SessionRegistry()
        self.service = KVService(config, self.store, self.pools, self.sessions)
        self.servicer = KVTierServicer(self.service, config.server.session_ping_s)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.addresses: list[str] = []
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        cfg = self.config.server
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ]
        )
        pb_grpc.add_KVTierServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if cfg.socket:
            path = os.path.abspath(cfg.socket)
            _prepare_socket_path(path)
            self.server.add_insecure_port(f"unix:{path}")
            self.addresses.append(f"unix:{path}")
        if cfg.tcp_address:
            port = self.server.add_insecure_port(cfg.tcp_address)
            if port == 0:
                raise OSError(f"cannot listen on {cfg.tcp_address}")
            self.addresses.append(cfg.tcp_address)
        await self.server.start()
        self.store.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self._expire_leases(), name="lease-reaper"))
        if (watchdog_s := systemd.watchdog_interval_s()) is not None:
            self._tasks.append(asyncio.create_task(self._watchdog(watchdog_s), name="watchdog"))
        log.info("kvtierd listening on %s", ", ".join(self.addresses))
        systemd.notify("READY=1\nSTATUS=serving")

    async def run_until_stopped(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self._stopping.wait()
        await self.stop()

    async def stop(self) -> None:
        log.info(
            "kvtierd stopping: draining requests for up to %.0fs",
            self.config.server.drain_timeout_s,
        )
        systemd.notify("STOPPING=1")
        await self.health.enter_graceful_shutdown()
        self.servicer.closing.set()
        if self.server is not None:
            await self.server.stop(self.config.server.drain_timeout_s)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.store.stop(flush=self.config.tiers.l2.flush_on_stop)
        self.pools.close()
        self.executor.shutdown(wait=True)
        self.store.close()
        if self.config.server.socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.abspath(self.config.server.socket))
        log.info("kvtierd stopped")

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            try:
                self.service.expire_leases()
            except Exception:
                log.exception("lease expiry failed")
                self.store.counters["background_errors"] += 1

    async def _watchdog(self, interval_s: float) -> None:
        while True:
            systemd.notify("WATCHDOG=1")
            await asyncio.sleep(interval_s)


def _prepare_socket_path(path: str) -> None:
    """Create the socket's folder; remove a stale socket, refuse a live one."""
    if len(path.encode()) > 107:
        raise OSError(
            errno.ENAMETOOLONG,
            f"socket path {path} is longer than the 107 bytes Unix sockets allow",
        )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another process is listening on {path}")


async def serve(config: Config, *, on_ready: Callable[[Daemon], None] | None = None) -> None:
    started = time.monotonic()
    daemon = Daemon(config)
    await daemon.start()
    log.info("started in %.2fs", time.monotonic() - started)
    if on_ready is not None:
        on_ready(daemon)
    await daemon.run_until_stopped()
