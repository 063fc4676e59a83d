"""The standard gRPC health service (grpc.health.v1) on the coordinator's port.

Load balancers, Kubernetes' gRPC probes and `grpc_health_probe` ask it whether the
coordinator serves: SERVING once every service is up, NOT_SERVING from the moment it
starts to stop (so a balancer sends no new node or client there while it drains), and
NOT_FOUND for a service it does not run. `Watch` streams each change.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.tessera.v1 import (
    admin_pb2,
    client_api_pb2,
    coordinator_pb2,
    jobs_pb2,
    ledger_pb2,
    training_pb2,
    verification_pb2,
)


class HealthServicer(health.aio.HealthServicer):
    """grpc's asyncio servicer, with List answered: grpc's is synchronous and
    unimplemented, which an asyncio server cannot run (nor refuse a malformed request for
    with INVALID_ARGUMENT, as every method here does)."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, int] = {}

    async def set(self, service: str, status: int) -> None:
        self._statuses[service] = status
        await super().set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        self._statuses = dict.fromkeys(self._statuses, health_pb2.HealthCheckResponse.NOT_SERVING)
        await super().enter_graceful_shutdown()

    async def Check(  # noqa: N802 - the gRPC method's name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await _name_fits(request.service, context)
        return await super().Check(request, context)

    async def Watch(  # noqa: N802 - the gRPC method's name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # A watcher's name stays in memory while it watches: no megabyte names.
        await _name_fits(request.service, context)
        await super().Watch(request, context)

    async def List(  # noqa: N802 - the gRPC method's name
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in self._statuses.items()
            }
        )


# "" is the server as a whole; the rest are the services on the coordinator's port.
SERVICES: tuple[str, ...] = (
    "",
    coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name,
    client_api_pb2.DESCRIPTOR.services_by_name["ClientApi"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
    ledger_pb2.DESCRIPTOR.services_by_name["Ledger"].full_name,
    verification_pb2.DESCRIPTOR.services_by_name["Verification"].full_name,
    jobs_pb2.DESCRIPTOR.services_by_name["Jobs"].full_name,
    training_pb2.DESCRIPTOR.services_by_name["TrainingStore"].full_name,
)


MAX_SERVICE_NAME = 256


async def _name_fits(name: str, context: grpc.aio.ServicerContext) -> None:
    if len(name) > MAX_SERVICE_NAME:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a service name of {len(name)} characters; service names here are at most "
            f"{MAX_SERVICE_NAME} (e.g. tessera.v1.ClientApi, or '' for the whole server)",
        )


def add_health(server: grpc.aio.Server) -> HealthServicer:
    servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


async def serving(servicer: HealthServicer) -> None:
    for name in SERVICES:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def stopping(servicer: HealthServicer) -> None:
    """Every service NOT_SERVING, for good: watchers hear it before the port closes."""
    await servicer.enter_graceful_shutdown()
