"""The gRPC health service (``grpc.health.v1.Health``): SERVING, or NOT_SERVING while the
daemon drains or stops.

grpcio-health-checking's own servicer writes a watcher's answer while holding the lock that
every status change takes. A watch needs no session, and a client that grants no
flow-control window leaves that write pending for as long as its connection stays open: one
such watch held the lock, so a Drain never answered and a SIGTERM never got past setting
NOT_SERVING. Here a status change only records the status and wakes the watchers; a watch
writes outside any shared state, so a watcher that reads nothing holds up only itself.

Invariants:
- A watch answers the current status of its service at once, then each status different
  from the last one it answered (intermediate ones may be skipped, as the protocol allows).
- After ``enter_graceful_shutdown`` every service is NOT_SERVING for good; later ``set``
  calls change nothing.

Thread-safety: the event loop only.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthService:
    """The status of each service name the daemon answers for ("" is the whole daemon)."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {"": SERVING}
        # Set (and replaced) on every change; each watcher waits on the one it last saw.
        self._changed = asyncio.Event()
        self._final = False

    def status(self, service: str = "") -> int:
        """The status of ``service`` now (SERVICE_UNKNOWN for a name never set)."""
        return self._status.get(service, SERVICE_UNKNOWN)

    def set(self, service: str, status: int) -> None:
        if self._final:
            return
        self._status[service] = status
        self._wake()

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on."""
        if self._final:
            return
        self._final = True
        for service in self._status:
            self._status[service] = NOT_SERVING
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
            raise AssertionError("unreachable: abort raises")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        last = None
        while True:
            # Taken before the status is read: a change during the write below has set it.
            changed = self._changed
            status = self._status.get(request.service, SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            await changed.wait()
