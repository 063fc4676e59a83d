"""The node's own gRPC server: the Ping-only fallback, plug-in discovery, addresses."""

import sys
import types

import grpc
import pytest

from node_agent import data_plane
from node_agent.data_plane import (
    NoModelStageServicer,
    advertised_address,
    join_host_port,
    split_host_port,
    start_server,
)
from protos import codec
from protos.tessera.v1 import client_api_pb2, stage_pb2, stage_pb2_grpc


@pytest.fixture
async def fallback_stub(agent_ctx):
    server, port = await start_server(agent_ctx, "127.0.0.1:0", NoModelStageServicer(agent_ctx))
    options = [
        ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
    ]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    try:
        yield stage_pb2_grpc.StageStub(channel)
    finally:
        await channel.close()
        await server.stop(grace=None)


async def test_ping_echoes_and_names_the_node(fallback_stub, agent_ctx) -> None:
    reply = await fallback_stub.Ping(stage_pb2.PingRequest(payload=b"\x00abc"), timeout=5)
    assert reply.payload == b"\x00abc"
    assert reply.node_id == agent_ctx.node_id


async def test_an_oversized_ping_is_refused_and_the_server_keeps_serving(fallback_stub) -> None:
    big = b"x" * (data_plane.MAX_PING_PAYLOAD_BYTES + 1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fallback_stub.Ping(stage_pb2.PingRequest(payload=big), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most" in err.value.details()
    assert (await fallback_stub.Ping(stage_pb2.PingRequest(payload=b"ok"), timeout=5)).payload


async def test_model_calls_say_there_is_no_model(fallback_stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fallback_stub.EndSession(stage_pb2.EndSessionRequest(session_id="s"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no model loaded" in err.value.details()

    call = fallback_stub.Forward(
        iter(
            [stage_pb2.ForwardRequest(session_id="s", capability=client_api_pb2.SignedCapability())]
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    deliveries = fallback_stub.Deliveries(stage_pb2.DeliveriesRequest(session_id="s"), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in deliveries:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no model loaded" in err.value.details()


async def test_a_busy_port_is_a_readable_error(agent_ctx) -> None:
    server, port = await start_server(agent_ctx, "127.0.0.1:0", NoModelStageServicer(agent_ctx))
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            await start_server(agent_ctx, f"127.0.0.1:{port}", NoModelStageServicer(agent_ctx))
    finally:
        await server.stop(grace=None)


async def test_a_listen_address_that_is_not_local_is_refused(agent_ctx) -> None:
    # 192.0.2.0/24 is reserved for documentation: never an address of this machine.
    with pytest.raises(OSError, match="cannot listen on 192.0.2.1:0"):
        await start_server(agent_ctx, "192.0.2.1:0", NoModelStageServicer(agent_ctx))


def test_the_stage_server_plugin_is_used_when_present(agent_ctx, monkeypatch) -> None:
    sentinel = object()
    fake = types.ModuleType("node_agent.stage_server")
    fake.build_stage_servicer = lambda ctx: (sentinel, ctx)
    monkeypatch.setitem(sys.modules, "node_agent.stage_server", fake)
    assert data_plane.build_stage_servicer(agent_ctx) == (sentinel, agent_ctx)


def test_without_the_stage_server_module_the_fallback_serves(agent_ctx, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "node_agent.stage_server", None)  # import fails
    assert isinstance(data_plane.build_stage_servicer(agent_ctx), NoModelStageServicer)


@pytest.mark.parametrize(
    ("listen_host", "coordinator", "expected"),
    [
        ("127.0.0.1", "10.1.2.3:7000", "127.0.0.1:5000"),  # a concrete host is kept
        ("0.0.0.0", "127.0.0.1:7000", "127.0.0.1:5000"),  # wildcard: the route's source
        ("::", "127.0.0.1:7000", "127.0.0.1:5000"),
        ("0.0.0.0", "localhost:7000", "127.0.0.1:5000"),
    ],
)
def test_advertised_address(listen_host, coordinator, expected) -> None:
    assert advertised_address(listen_host, 5000, coordinator) == expected


def test_host_port_parsing() -> None:
    assert split_host_port("[::1]:7000") == ("::1", 7000)
    assert join_host_port("::1", 7000) == "[::1]:7000"
    assert split_host_port("example.org:1") == ("example.org", 1)
    for bad in ("7000", "host:", ":7000", "host:99999", "host:x"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_host_port(bad)
