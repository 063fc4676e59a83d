"""The relay for nodes nobody can dial (coordinator/nat_relay.py), over real sockets.

A real gRPC server runs the relay on loopback. The node's end is either the real one
(node_agent/nat_tunnel.py, joined to a TCP echo server that stands in for its data plane)
or a raw tunnel the test drives itself, to send what a real node never would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from data_plane.stage_harness import node_context

from coordinator import nat_relay
from coordinator.nat_relay import NatRelay
from node_agent.nat_tunnel import NatTunnel
from protos.tessera.v1 import relay_pb2, relay_pb2_grpc

TICKET = b"the-ticket"


class Relay:
    def __init__(self, host: str | None = "127.0.0.1") -> None:
        self.relayed: list[tuple[str, str]] = []
        self.unrelayed: list[str] = []
        self.node_id = ""
        self.service = NatRelay(
            host,
            lambda node_id, ticket: node_id == self.node_id and ticket == TICKET,
            on_relayed=lambda n, a: self.relayed.append((n, a)),
            on_unrelayed=self.unrelayed.append,
        )
        self.server = grpc.aio.server()
        self.service.add_to_server(self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"


@pytest.fixture
async def relay() -> AsyncIterator[Relay]:
    r = Relay()
    r.node_id = "n1"
    await r.server.start()
    yield r
    await r.service.stop()
    await r.server.stop(0)


async def echo_server() -> tuple[asyncio.base_events.Server, int]:
    """The node's data plane, reduced to upper-casing what it gets."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data.upper())
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def round_trip(address: str, payload: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    await writer.drain()
    got = await reader.readexactly(len(payload))
    writer.close()
    return got


async def test_connections_to_the_relay_reach_the_node_s_data_plane(relay, tmp_path) -> None:
    ctx = node_context(tmp_path, b"")
    ctx.coordinator_address, ctx.attach_ticket = relay.address, TICKET
    relay.node_id = ctx.node_id
    data_plane, port = await echo_server()
    tunnel = NatTunnel(ctx, "127.0.0.1", port)
    running = asyncio.ensure_future(tunnel.run())
    try:
        await asyncio.wait_for(tunnel.welcomed.wait(), 10)
        assert relay.relayed == [(ctx.node_id, tunnel.address)]
        # Several clients at once, one of them with more than a tunnel message holds.
        payloads = [b"hello", b"x" * 300_000, bytes(range(256)) * 8]
        answers = await asyncio.gather(*(round_trip(tunnel.address, p) for p in payloads))
        assert answers == [p.upper() for p in payloads]
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        data_plane.close()
    # The tunnel is gone: so is the node's port on the relay.
    for _ in range(50):
        if relay.unrelayed:
            break
        await asyncio.sleep(0.1)
    assert relay.unrelayed == [ctx.node_id]
    with pytest.raises(OSError):
        await round_trip(tunnel.address, b"anyone?")


async def tunnel_call(relay: Relay, messages: list[relay_pb2.TunnelUp]):  # noqa: ANN201
    """A raw tunnel that has sent ``messages`` (and keeps its side open)."""
    channel = grpc.aio.insecure_channel(relay.address)
    call = relay_pb2_grpc.RelayStub(channel).Tunnel()
    for message in messages:
        await call.write(message)
    return channel, call


def hello(node_id: str, ticket: bytes = TICKET) -> relay_pb2.TunnelUp:
    return relay_pb2.TunnelUp(hello=relay_pb2.TunnelHello(node_id=node_id, attach_ticket=ticket))


async def refused(relay: Relay, messages: list[relay_pb2.TunnelUp]) -> grpc.aio.AioRpcError:
    channel, call = await tunnel_call(relay, messages)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async with asyncio.timeout(20):
                while await call.read() is not grpc.aio.EOF:
                    pass
        return err.value
    finally:
        await channel.close()


async def test_a_tunnel_without_a_valid_hello_is_refused(relay) -> None:
    data = relay_pb2.TunnelUp(data=relay_pb2.TunnelData(conn=1, data=b"x"))
    err = await refused(relay, [data])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "hello" in err.details()
    err = await refused(relay, [hello(relay.node_id, b"stolen")])
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "register again" in err.details()
    err = await refused(relay, [hello("")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert relay.relayed == []


async def test_hostile_messages_end_the_tunnel_and_its_port(relay) -> None:
    oversized = relay_pb2.TunnelUp(
        data=relay_pb2.TunnelData(conn=1, data=b"x" * (nat_relay.MAX_DATA_BYTES + 1))
    )
    for bad, words in (
        (hello(relay.node_id), "data and close"),  # a second hello
        (relay_pb2.TunnelUp(), "an empty message"),
        (oversized, "at most"),
    ):
        relay.relayed.clear()
        err = await refused(relay, [hello(relay.node_id), bad])
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details()
        [(_, address)] = relay.relayed
        with pytest.raises(OSError):
            await round_trip(address, b"still there?")
    assert relay.unrelayed == [relay.node_id] * 3


async def test_connections_beyond_the_limit_are_closed(relay, monkeypatch) -> None:
    monkeypatch.setattr(nat_relay, "MAX_CONNECTIONS", 2)
    channel, call = await tunnel_call(relay, [hello(relay.node_id)])
    try:
        welcome = await call.read()
        host, port = welcome.welcome.address.rsplit(":", 1)
        kept = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        opened = [await call.read() for _ in range(2)]
        assert [m.open.conn for m in opened] == [1, 2]
        reader, _ = await asyncio.open_connection(host, int(port))
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed at once
        for _, writer in kept:
            writer.close()
    finally:
        call.cancel()
        await channel.close()


async def test_a_coordinator_without_a_relay_says_so(tmp_path) -> None:
    relay = Relay(host=None)
    relay.node_id = "n1"
    await relay.server.start()
    try:
        err = await refused(relay, [hello("n1")])
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "--relay-host" in err.details()
    finally:
        await relay.server.stop(0)
