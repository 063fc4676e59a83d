"""The relay for nodes nobody can dial (coordinator/nat_relay.py), over real sockets.

A real gRPC server runs the relay on loopback. The node's end is either the real one
(node_agent/nat_tunnel.py, joined to a TCP echo server that stands in for its data plane)
or a raw tunnel the test drives itself, to send what a real node never would.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from data_plane.stage_harness import node_context
from support.ports import free_port_range

from coordinator import nat_relay
from coordinator.nat_relay import NatRelay
from node_agent import nat_tunnel
from node_agent.nat_tunnel import NatTunnel
from protos.tessera.v1 import relay_pb2, relay_pb2_grpc

TICKET = b"the-ticket"


class Relay:
    def __init__(
        self, host: str | None = "127.0.0.1", listen: str = "127.0.0.1:0", **options: Any
    ) -> None:
        self.relayed: list[tuple[str, str]] = []
        self.unrelayed: list[str] = []
        self.node_id = ""
        self.others: set[str] = set()  # more registered nodes
        self.service = NatRelay(
            host,
            lambda node_id, ticket: node_id in {self.node_id, *self.others} and ticket == TICKET,
            on_relayed=lambda n, a: self.relayed.append((n, a)),
            on_unrelayed=self.unrelayed.append,
            **options,
        )
        self.server = grpc.aio.server()
        self.service.add_to_server(self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port(listen)}"


@pytest.fixture
async def relay() -> AsyncIterator[Relay]:
    r = Relay()
    r.node_id = "n1"
    await r.server.start()
    yield r
    await r.service.stop()
    await r.server.stop(0)


async def echo_server(
    ends: list[int] | None = None, stall_on: bytes = b""
) -> tuple[asyncio.base_events.Server, int]:
    """The node's data plane, reduced to upper-casing what it gets; each connection that
    ends is counted in ``ends``, and one that begins with ``stall_on`` is never read again
    (a stuck handler)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if stall_on and data.startswith(stall_on):
                    await asyncio.Event().wait()  # nothing more is read from this one
                writer.write(data.upper())
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            if ends is not None:
                ends.append(1)

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


async def node_tunnel(
    relay: Relay, tmp_path: Path, ends: list[int] | None = None, stall_on: bytes = b""
) -> tuple[NatTunnel, asyncio.Future[None], asyncio.base_events.Server]:
    """A real node end registered with ``relay``, joined to an echo data plane
    (``echo_server``): the tunnel, its running task, and the data plane."""
    ctx = node_context(tmp_path, b"")
    ctx.coordinator_address, ctx.attach_ticket = relay.address, TICKET
    relay.node_id = ctx.node_id
    data_plane, port = await echo_server(ends, stall_on)
    tunnel = NatTunnel(ctx, "127.0.0.1", port)
    return tunnel, asyncio.ensure_future(tunnel.run()), data_plane


async def test_connections_to_the_relay_reach_the_node_s_data_plane(relay, tmp_path) -> None:
    tunnel, running, data_plane = await node_tunnel(relay, tmp_path)
    try:
        await asyncio.wait_for(tunnel.welcomed.wait(), 10)
        assert relay.relayed == [(relay.node_id, tunnel.address)]
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
    assert relay.unrelayed == [relay.node_id]
    with pytest.raises(OSError):
        await round_trip(tunnel.address, b"anyone?")


async def all_of(reader: asyncio.StreamReader) -> bytes:
    """Everything the connection brings until it ends (closed or reset)."""
    got = bytearray()
    try:
        while chunk := await reader.read(65536):
            got += chunk
    except ConnectionError:
        pass
    return bytes(got)


async def flood(address: str, nbytes: int, head: bytes = b"") -> asyncio.StreamReader:
    """A client that sends ``head`` and ``nbytes`` more, and reads nothing back."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"x" * nbytes)  # the transport sends it on as the relay takes it
    return reader


@pytest.mark.parametrize("limit", ["per-connection", "per-tunnel"])
async def test_a_client_that_does_not_read_is_cut_off_and_the_others_go_on(
    relay, tmp_path, monkeypatch, limit: str
) -> None:
    # Before: the relay waited for each client to take its bytes, so one that stopped
    # reading held up every connection of the node, and anyone could freeze a relayed
    # node by calling it and not reading the answers.
    if limit == "per-connection":
        monkeypatch.setattr(nat_relay, "UNREAD_LIMIT", 256 << 10)
    else:
        monkeypatch.setattr(nat_relay, "TUNNEL_UNREAD_LIMIT", 256 << 10)
    data_plane_ends: list[int] = []
    tunnel, running, data_plane = await node_tunnel(relay, tmp_path, data_plane_ends)
    try:
        await asyncio.wait_for(tunnel.welcomed.wait(), 10)
        hog = await flood(tunnel.address, 24 << 20)  # its echo comes back, unread
        for i in range(20):
            payload = f"still served {i}".encode() * 1000
            assert await asyncio.wait_for(round_trip(tunnel.address, payload), 10) == (
                payload.upper()
            )
        await asyncio.wait_for(all_of(hog), 20)  # cut off
        # The node was told: its connection to the data plane closed too (one for the hog,
        # one per round trip).
        for _ in range(100):
            if len(data_plane_ends) == 21:
                break
            await asyncio.sleep(0.05)
        assert len(data_plane_ends) == 21
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        data_plane.close()


async def test_a_data_plane_connection_that_is_not_read_is_cut_off(
    relay, tmp_path, monkeypatch
) -> None:
    # The node's end writes to its own data plane the same way: one connection it does
    # not read (a stuck handler) must not hold up the others.
    monkeypatch.setattr(nat_tunnel, "UNREAD_LIMIT", 256 << 10)
    tunnel, running, data_plane = await node_tunnel(relay, tmp_path, stall_on=b"HOG!")
    try:
        await asyncio.wait_for(tunnel.welcomed.wait(), 10)
        hog = await flood(tunnel.address, 24 << 20, head=b"HOG!")
        for i in range(20):
            payload = f"still served {i}".encode() * 1000
            assert await asyncio.wait_for(round_trip(tunnel.address, payload), 10) == (
                payload.upper()
            )
        await asyncio.wait_for(all_of(hog), 20)  # the node cut it, and the relay its client
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        data_plane.close()


async def test_one_address_cannot_take_every_place_and_silent_connections_are_closed(
    relay, tmp_path, monkeypatch
) -> None:
    # Before: anyone could open MAX_CONNECTIONS idle connections to a relayed node's port,
    # and its clients found the relay refusing theirs.
    monkeypatch.setattr(nat_relay, "MAX_CONNECTIONS_PER_ADDRESS", 2)
    monkeypatch.setattr(nat_relay, "FIRST_BYTES_TIMEOUT_S", 0.5)
    data_plane_ends: list[int] = []
    tunnel, running, data_plane = await node_tunnel(relay, tmp_path, data_plane_ends)
    try:
        await asyncio.wait_for(tunnel.welcomed.wait(), 10)
        host, port = tunnel.address.rsplit(":", 1)
        # Loopback answers all of 127/8: a second address stands for a stranger's.
        stranger = [
            await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0))
            for _ in range(3)
        ]
        for _, writer in stranger:
            writer.write(b"hold")
        third_reader, _ = stranger[2]
        assert await asyncio.wait_for(all_of(third_reader), 10) == b""  # refused, unanswered
        assert await asyncio.wait_for(round_trip(tunnel.address, b"mine"), 10) == b"MINE"
        for reader, _ in stranger[:2]:
            assert await asyncio.wait_for(reader.readexactly(4), 10) == b"HOLD"
        # A connection that says nothing is closed, and the node's end with it.
        silent, _ = await asyncio.open_connection(host, int(port))
        assert await asyncio.wait_for(all_of(silent), 10) == b""
        for _ in range(100):
            if len(data_plane_ends) == 2:  # the round trip's and the silent one's
                break
            await asyncio.sleep(0.05)
        assert len(data_plane_ends) == 2
        for _, writer in stranger[:2]:
            writer.close()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        data_plane.close()


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
    channel = grpc.aio.insecure_channel(relay.address)
    call = relay_pb2_grpc.RelayStub(channel).Tunnel()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async with asyncio.timeout(20):
                # The relay may refuse before it reads what is sent (a coordinator without a
                # relay does): a write then fails with its answer.
                for message in messages:
                    await call.write(message)
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
    # The relay forgets the tunnel as its handler ends, which may be just after the node
    # hears the refusal.
    for _ in range(50):
        if len(relay.unrelayed) >= 3:
            break
        await asyncio.sleep(0.1)
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


async def started(relay: Relay) -> Relay:
    await relay.server.start()
    return relay


async def welcomed(relay: Relay, node_id: str) -> tuple[grpc.aio.Channel, Any, str]:
    """A raw tunnel of ``node_id``: its channel, its call, and the address it was given."""
    channel, call = await tunnel_call(relay, [hello(node_id)])
    message = await asyncio.wait_for(call.read(), 10)
    assert message.WhichOneof("kind") == "welcome", message
    return channel, call, message.welcome.address


async def test_ports_come_from_the_range_and_a_full_range_is_refused() -> None:
    low, high = free_port_range(3)
    relay = await started(Relay(ports=(low, high)))
    relay.others = {"n1", "n2", "n3"}
    other_program = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    other_program.bind(("127.0.0.1", low + 1))
    other_program.listen(1)
    opened = []
    try:
        for node_id in ("n1", "n2"):
            opened.append(await welcomed(relay, node_id))
        # The port another program holds is passed over.
        assert [address for _, _, address in opened] == [f"127.0.0.1:{low}",
                                                         f"127.0.0.1:{high}"]  # fmt: skip
        err = await refused(relay, [hello("n3")])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"all 3 relay ports ({low}-{high}) are in use" in err.details()
        assert "--relay-ports" in err.details()
        # n1 leaves: its port serves the next node.
        channel, call, _ = opened.pop(0)
        call.cancel()
        await channel.close()
        for _ in range(100):
            if "n1" in relay.unrelayed:
                break
            await asyncio.sleep(0.05)
        assert relay.unrelayed == ["n1"]
        opened.append(await welcomed(relay, "n3"))
        assert opened[-1][2] == f"127.0.0.1:{low}"
    finally:
        other_program.close()
        for channel, call, _ in opened:
            call.cancel()
            await channel.close()
        await relay.service.stop()
        await relay.server.stop(0)


@pytest.mark.parametrize("ranged", [False, True], ids=["any-port", "ranged"])
async def test_a_tunnel_that_comes_back_keeps_its_port(ranged: bool) -> None:
    relay = await started(Relay(ports=free_port_range(4) if ranged else None))
    relay.node_id = "n1"
    relay.others = {"n2"}
    try:
        channel, call, address = await welcomed(relay, "n1")
        # Replaced while still open (a node that opened a new tunnel before the old one's
        # end reached the relay): the new one gets the port, the old one ends.
        channel2, call2, again = await welcomed(relay, "n1")
        assert again == address
        assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF
        await channel.close()
        # Broken, then opened again after another node took a port meanwhile.
        call2.cancel()
        await channel2.close()
        for _ in range(100):
            if relay.unrelayed:
                break
            await asyncio.sleep(0.05)
        channel3, call3, other = await welcomed(relay, "n2")
        assert other != address
        channel4, call4, back = await welcomed(relay, "n1")
        assert back == address
        # Placement heard: relayed at that address, gone, relayed there again.
        assert [a for n, a in relay.relayed if n == "n1"] == [address] * 3
        assert relay.unrelayed == ["n1"]
        for c, k in ((channel3, call3), (channel4, call4)):
            k.cancel()
            await c.close()
    finally:
        await relay.service.stop()
        await relay.server.stop(0)


async def test_the_relay_listens_on_its_bind_address_and_names_its_public_host() -> None:
    # A cloud VM: clients reach it at a public name that none of its interfaces has.
    relay = await started(Relay(host="relay.example.org", bind="127.0.0.1"))
    relay.node_id = "n1"
    try:
        channel, call, address = await welcomed(relay, "n1")
        host, port = address.rsplit(":", 1)
        assert host == "relay.example.org"
        _, writer = await asyncio.open_connection("127.0.0.1", int(port))
        opened = await asyncio.wait_for(call.read(), 10)
        assert opened.WhichOneof("kind") == "open"
        writer.close()
        call.cancel()
        await channel.close()
    finally:
        await relay.service.stop()
        await relay.server.stop(0)


async def test_a_ranged_relay_gives_a_node_its_port_again_after_a_restart(tmp_path) -> None:
    # With --relay-ports a node's relay address outlives a coordinator restart: the
    # restarted relay remembers nothing, but the node's tunnel asks for its former port.
    low, high = free_port_range(3)
    other_program = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    other_program.bind(("127.0.0.1", low))  # held at first: the node gets low + 1
    other_program.listen(1)
    relay = await started(Relay(ports=(low, high)))
    tunnel, running, data_plane = await node_tunnel(relay, tmp_path)
    restarted: Relay | None = None
    try:
        await asyncio.wait_for(tunnel.welcomed.wait(), 10)
        assert tunnel.address == f"127.0.0.1:{low + 1}"
        other_program.close()  # low is free now: a relay that forgot would hand it out first
        await relay.service.stop()
        await relay.server.stop(0)
        for _ in range(100):
            if not tunnel.welcomed.is_set():
                break
            await asyncio.sleep(0.05)
        restarted = Relay(ports=(low, high), listen=relay.address)
        restarted.node_id = relay.node_id
        await restarted.server.start()
        await asyncio.wait_for(tunnel.welcomed.wait(), 30)
        assert tunnel.address == f"127.0.0.1:{low + 1}"
        assert await round_trip(tunnel.address, b"still you?") == b"STILL YOU?"
    finally:
        other_program.close()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        data_plane.close()
        for r in (relay, restarted):
            if r is not None:
                await r.service.stop()
                await r.server.stop(0)


async def test_a_former_port_outside_the_range_is_not_given() -> None:
    # A node can name any number there: only a free port of the range is ever given.
    low, high = free_port_range(2)
    relay = await started(Relay(ports=(low, high)))
    relay.others = {"n1", "n2"}
    opened = []
    try:
        for node_id, asked in (("n1", 22), ("n2", 70_000)):
            message = relay_pb2.TunnelUp(
                hello=relay_pb2.TunnelHello(
                    node_id=node_id, attach_ticket=TICKET, previous_port=asked
                )  # fmt: skip
            )
            channel, call = await tunnel_call(relay, [message])
            opened.append((channel, call))
            welcome = await asyncio.wait_for(call.read(), 10)
            assert low <= int(welcome.welcome.address.rsplit(":", 1)[1]) <= high
    finally:
        for channel, call in opened:
            call.cancel()
            await channel.close()
        await relay.service.stop()
        await relay.server.stop(0)


async def backlogged(writer: asyncio.StreamWriter) -> None:
    """Until ``writer``'s unsent bytes stop going down: whatever its relay takes on has
    been taken (a queue that is full, the tunnel's own buffers)."""
    last = -1
    steady = 0
    while steady < 5:
        await asyncio.sleep(0.05)
        size = writer.transport.get_write_buffer_size()
        steady = steady + 1 if size == last else 0
        last = size


async def test_a_flooding_client_does_not_hold_up_the_node_s_other_connections(relay) -> None:
    # Before: every connection's bytes waited in one queue towards the node, so a client that
    # sent as fast as it could put up to QUEUE_MESSAGES x READ_CHUNK (16 MiB) ahead of every
    # other client's, and a small request waited behind all of it. The node's end here is
    # the test, with a small fixed stream window: what it gets first is what the relay sent
    # first, not what gRPC's flow control let ahead.
    channel = grpc.aio.insecure_channel(
        relay.address, options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]
    )
    call = relay_pb2_grpc.RelayStub(channel).Tunnel()
    await call.write(hello(relay.node_id))
    address = (await asyncio.wait_for(call.read(), 10)).welcome.address
    host, port = address.rsplit(":", 1)
    flooder: asyncio.StreamWriter | None = None
    asker: asyncio.StreamWriter | None = None
    try:
        _, flooder = await asyncio.open_connection(host, int(port))
        flooder.write(b"x" * (64 << 20))  # the node, not reading yet, holds this back
        opened = await asyncio.wait_for(call.read(), 10)
        flooding = opened.open.conn
        await backlogged(flooder)
        _, asker = await asyncio.open_connection(host, int(port))
        asker.write(b"ping")
        flooded = 0  # the flooder's bytes the node got before the small request
        async with asyncio.timeout(30):
            while True:
                message = await call.read()
                kind = message.WhichOneof("kind")
                if kind == "data" and message.data.conn == flooding:
                    flooded += len(message.data.data)
                elif kind == "data":
                    assert message.data.data == b"ping"
                    break
        # What the flooder's own queue held and a stream window, not its backlog (more
        # than 16 MiB before).
        assert flooded <= 4 * nat_relay.CONN_QUEUE_MESSAGES * nat_relay.READ_CHUNK, flooded
    finally:
        for writer in (flooder, asker):
            if writer is not None:
                writer.close()
        call.cancel()
        await channel.close()


def down(kind: str, conn: int, data: bytes = b"") -> relay_pb2.TunnelDown:
    if kind == "open":
        return relay_pb2.TunnelDown(open=relay_pb2.TunnelOpen(conn=conn))
    if kind == "close":
        return relay_pb2.TunnelDown(close=relay_pb2.TunnelClose(conn=conn))
    return relay_pb2.TunnelDown(data=relay_pb2.TunnelData(conn=conn, data=data))


def described(message: relay_pb2.TunnelDown | None) -> tuple[str, int, bytes] | None:
    if message is None:
        return None
    kind = message.WhichOneof("kind")
    body = getattr(message, kind)
    return kind, body.conn, getattr(body, "data", b"")


async def test_the_queue_towards_the_node_takes_the_connections_in_turn() -> None:
    queue = nat_relay._FairQueue(per_conn=3)
    for conn, count in ((1, 3), (2, 1), (3, 2)):
        for i in range(count):
            await queue.put(conn, down("data", conn, b"%d" % i))
    # Connection 1 is full: its next put waits, and only it.
    waiting = asyncio.ensure_future(queue.put(1, down("data", 1, b"3")))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    await asyncio.wait_for(queue.put(2, down("data", 2, b"1")), 1)
    got = [described(await queue.get()) for _ in range(3)]
    await asyncio.wait_for(waiting, 1)  # room again
    got += [described(await queue.get()) for _ in range(5)]
    assert [(conn, data) for _, conn, data in got] == [
        (1, b"0"), (2, b"0"), (3, b"0"),
        (1, b"1"), (2, b"1"), (3, b"1"),
        (1, b"2"), (1, b"3"),
    ]  # fmt: skip


async def test_opens_and_closes_keep_their_place_and_a_close_is_never_lost() -> None:
    queue = nat_relay._FairQueue(per_conn=2)
    queue.put_control(1, down("open", 1))
    await queue.put(1, down("data", 1, b"a"))
    await queue.put(1, down("data", 1, b"b"))
    waiting = asyncio.ensure_future(queue.put(1, down("data", 1, b"late")))
    queue.put_control(2, down("open", 2))
    await queue.put(2, down("data", 2, b"c"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    # Connection 1 is full, yet its close goes in at once (a cut-off cannot wait for room)
    # and after its data; the put that waited for room is dropped: it would follow the close.
    queue.put_control(1, down("close", 1))
    queue.put_control(2, down("close", 2))
    await asyncio.wait_for(waiting, 1)
    got = [described(await queue.get()) for _ in range(7)]
    assert got == [
        ("open", 1, b""), ("open", 2, b""),
        ("data", 1, b"a"), ("data", 2, b"c"),
        ("data", 1, b"b"), ("close", 2, b""),
        ("close", 1, b""),
    ]  # fmt: skip
    assert queue.conns() == set()  # nothing left of them
    # Many connections, every queue full: every close still goes.
    for conn in range(10, 20):
        for i in range(2):
            await queue.put(conn, down("data", conn, b"%d" % i))
        queue.put_control(conn, down("close", conn))
    got = [described(await queue.get()) for _ in range(30)]
    closes = [conn for kind, conn, _ in got if kind == "close"]
    assert sorted(closes) == list(range(10, 20))
    for conn in closes:
        assert got.index(("close", conn, b"")) > got.index(("data", conn, b"1"))


async def test_closing_the_queue_ends_a_waiting_get_and_put_and_drops_the_rest() -> None:
    queue = nat_relay._FairQueue(per_conn=1)
    getting = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0.01)
    assert not getting.done()
    await queue.put(1, down("data", 1, b"a"))  # wakes the get
    assert described(await asyncio.wait_for(getting, 1)) == ("data", 1, b"a")
    getting = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0.01)
    queue.close()  # so does the end of the tunnel
    assert await asyncio.wait_for(getting, 1) is None
    queue = nat_relay._FairQueue(per_conn=1)
    await queue.put(2, down("data", 2, b"b"))
    putting = asyncio.ensure_future(queue.put(2, down("data", 2, b"c")))  # full: waits
    await asyncio.sleep(0.01)
    assert not putting.done()
    queue.close()
    await asyncio.wait_for(putting, 1)
    queue.put_control(3, down("close", 3))
    await queue.put(3, down("data", 3, b"d"))
    assert await asyncio.wait_for(queue.get(), 1) is None  # nothing of it goes now
    assert queue.conns() == set()
