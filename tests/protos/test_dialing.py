"""A node that comes up at the address of a dead one is reachable at once.

The CI flake this pins down: a client channel to a node that had died stayed open in the
test process; a later node got the same (recycled) ephemeral port, and every new channel
to it failed with "Connection refused" for minutes, because gRPC shared the dead
connection's reconnect backoff among channels of equal options. Restarting a node on its
--listen port is the same case in production.
"""

from __future__ import annotations

import socket

import grpc
import pytest

from client.channels import CHANNEL_OPTIONS as CLIENT_OPTIONS
from client.channels import ChannelPool
from coordinator.verifier.stage_runner import OPTIONS as VERIFIER_OPTIONS
from node_agent.agent import CHANNEL_OPTIONS as AGENT_OPTIONS
from protos.dialing import DIAL_OPTIONS
from protos.tessera.v1 import stage_pb2, stage_pb2_grpc


class _Echo(stage_pb2_grpc.StageServicer):
    async def Ping(  # noqa: N802 - gRPC method name
        self, request: stage_pb2.PingRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.PingResponse:
        return stage_pb2.PingResponse(payload=request.payload, node_id="revived")


def _free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


async def _ping(channel: grpc.aio.Channel) -> stage_pb2.PingResponse:
    return await stage_pb2_grpc.StageStub(channel).Ping(stage_pb2.PingRequest(), timeout=2.0)


@pytest.mark.parametrize(
    "options",
    [CLIENT_OPTIONS, AGENT_OPTIONS, VERIFIER_OPTIONS],
    ids=["client", "node-agent", "coordinator"],
)
async def test_a_new_channel_does_not_inherit_a_dead_address_s_backoff(
    options: list[tuple[str, int]],
) -> None:
    assert set(DIAL_OPTIONS) <= set(options), "every component dials with DIAL_OPTIONS"
    address = _free_address()
    stale = grpc.aio.insecure_channel(address, options=options)
    server = grpc.aio.server()
    try:
        for _ in range(2):  # two failures: the connection is now in reconnect backoff
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await _ping(stale)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        stage_pb2_grpc.add_StageServicer_to_server(_Echo(), server)
        assert server.add_insecure_port(address) != 0
        await server.start()
        async with grpc.aio.insecure_channel(address, options=options) as fresh:
            assert (await _ping(fresh)).node_id == "revived"
    finally:
        await stale.close()
        await server.stop(None)


async def test_a_client_pool_reaches_a_node_restarted_on_the_same_port() -> None:
    address = _free_address()
    old_pool, new_pool = ChannelPool(), ChannelPool()
    server = grpc.aio.server()
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await _ping(old_pool.get(address))
        stage_pb2_grpc.add_StageServicer_to_server(_Echo(), server)
        assert server.add_insecure_port(address) != 0
        await server.start()
        assert (await _ping(new_pool.get(address))).node_id == "revived"
    finally:
        await old_pool.close()
        await new_pool.close()
        await server.stop(None)
