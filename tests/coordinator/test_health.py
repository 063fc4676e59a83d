"""The standard gRPC health service on the coordinator's port (coordinator/health.py):
what load balancers and `grpc_health_probe` ask before they send a node or client there."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.coordinator_harness import harness_settings

from coordinator.health import SERVICES
from coordinator.server import running_coordinator

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_serving_while_up_and_not_serving_from_the_moment_it_stops(tmp_path: Path) -> None:
    assert "tessera.v1.ClientApi" in SERVICES and "tessera.v1.Jobs" in SERVICES
    stop = asyncio.Event()
    up: asyncio.Queue[str] = asyncio.Queue()

    async def coordinator() -> None:
        async with running_coordinator(harness_settings(tmp_path)) as running:
            await up.put(running.address)
            await stop.wait()

    task = asyncio.create_task(coordinator())
    address = await asyncio.wait_for(up.get(), 30)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in SERVICES:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == SERVING, service
        listed = await stub.List(health_pb2.HealthListRequest())
        assert {name: s.status for name, s in listed.statuses.items()} == dict.fromkeys(
            SERVICES, SERVING
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Check(health_pb2.HealthCheckRequest(service="tessera.v1.Nothing"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        huge = health_pb2.HealthCheckRequest(service="x" * 1_000_000)
        for call in (stub.Check(huge), stub.Watch(huge).read()):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 256" in caught.value.details()
        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="tessera.v1.Later"))
        assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()

        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == SERVING
        stop.set()  # SIGTERM, in effect: the watcher hears it before the port closes
        assert (await asyncio.wait_for(watch.read(), 10)).status == NOT_SERVING
    await asyncio.wait_for(task, 30)
