"""The node's end of the relay (coordinator/nat_relay.py) for a node nobody can dial.

When the coordinator could not dial the node's data plane back at registration, the agent
opens `Relay.Tunnel` to it (an outbound call, which NAT lets through) and keeps it open:
each client connection the relay accepts at the node's public relay address arrives here
as `open`, and is joined, byte for byte, to a new TCP connection to this node's own data
plane on loopback. The tunnel is opened again with back-off when it breaks, with the
ticket of the agent's latest registration, until the agent stops it. One loop writes every
connection's bytes, so it never waits for one to be read: a connection that leaves more
than UNREAD_LIMIT bytes unread is cut off instead (protos/tunnel_writes.py).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from node_agent.backoff import Backoff
from node_agent.context import AgentContext
from node_agent.data_plane import split_host_port
from protos import dialing, tunnel_writes
from protos.tessera.v1 import relay_pb2, relay_pb2_grpc

log = logging.getLogger(__name__)

READ_CHUNK = 64 * 1024
QUEUE_MESSAGES = 256  # towards the relay, all connections together
UNREAD_LIMIT = tunnel_writes.MAX_UNREAD_BYTES  # a connection to the data plane
# The coordinator has no relay (or refuses this node): trying again will not help.
NO_RELAY = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION})


class NatTunnel:
    """Carries the relay's connections to this node's data plane at ``local_host``:
    ``local_port``."""

    def __init__(self, ctx: AgentContext, local_host: str, local_port: int) -> None:
        self._ctx = ctx
        self._local_host = local_host
        self._local_port = local_port
        self.address = ""  # the public address the relay gave this node
        self.welcomed = asyncio.Event()

    async def run(self) -> None:
        """Keep the tunnel open until cancelled (or until the coordinator has no relay)."""
        backoff = Backoff()
        while True:
            try:
                await self._once(backoff)
                reason = "the relay ended the tunnel"
            except grpc.aio.AioRpcError as err:
                if err.code() in NO_RELAY:
                    log.warning("no relay for this node: %s", err.details())
                    return
                reason = f"{err.code().name}: {err.details()}"
            delay = backoff.next_delay()
            log.warning("relay tunnel lost (%s); opening it again in %.1fs", reason, delay)
            self.welcomed.clear()
            await asyncio.sleep(delay)

    async def _once(self, backoff: Backoff) -> None:
        up: asyncio.Queue[relay_pb2.TunnelUp] = asyncio.Queue(QUEUE_MESSAGES)
        conns: dict[int, asyncio.StreamWriter] = {}
        pumps: set[asyncio.Task[None]] = set()
        hello = relay_pb2.TunnelHello(
            node_id=self._ctx.node_id,
            attach_ticket=self._ctx.attach_ticket,
            previous_port=_port_of(self.address),
        )

        async def pump(conn: int, reader: asyncio.StreamReader) -> None:
            """The data plane's bytes on ``conn``, to the relay, then its close."""
            try:
                while chunk := await reader.read(READ_CHUNK):
                    await up.put(
                        relay_pb2.TunnelUp(data=relay_pb2.TunnelData(conn=conn, data=chunk))
                    )
            except ConnectionError:
                pass
            finally:
                if conns.pop(conn, None) is not None:
                    await up.put(relay_pb2.TunnelUp(close=relay_pb2.TunnelClose(conn=conn)))

        async def open_local(conn: int) -> None:
            try:
                reader, writer = await asyncio.open_connection(self._local_host, self._local_port)
            except OSError as err:
                log.warning("relay: cannot reach this node's own data plane: %s", err)
                await up.put(relay_pb2.TunnelUp(close=relay_pb2.TunnelClose(conn=conn)))
                return
            conns[conn] = writer
            task = asyncio.ensure_future(pump(conn, reader))
            pumps.add(task)
            task.add_done_callback(pumps.discard)

        channel = dialing.aio_channel(self._ctx.coordinator_address, self._ctx.channel_options)
        call = relay_pb2_grpc.RelayStub(channel).Tunnel()

        async def send() -> None:
            # One writer: a gRPC stream takes one write at a time.
            await call.write(relay_pb2.TunnelUp(hello=hello))
            while True:
                await call.write(await up.get())

        sending = asyncio.ensure_future(send())
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                kind = message.WhichOneof("kind")
                if kind == "welcome":
                    self.address = message.welcome.address
                    self.welcomed.set()
                    backoff.reset()
                    log.info("clients reach this node through the relay at %s", self.address)
                elif kind == "open":
                    await open_local(message.open.conn)
                elif kind == "data":
                    conn = message.data.conn
                    writer = conns.get(conn)
                    if writer is not None and not tunnel_writes.write_or_cut(
                        writer, message.data.data, UNREAD_LIMIT
                    ):
                        # Its pump sees the end and tells the relay, which cuts the client.
                        log.warning(
                            "relay: this node's data plane left more than %d bytes of "
                            "connection %d unread; cut it off",
                            UNREAD_LIMIT,
                            conn,
                        )
                elif kind == "close":
                    writer = conns.pop(message.close.conn, None)
                    if writer is not None:
                        writer.close()
            if sending.done() and sending.exception() is not None:
                raise sending.exception()  # type: ignore[misc]
        finally:
            sending.cancel()
            call.cancel()
            for writer in conns.values():
                writer.close()
            conns.clear()
            for task in list(pumps):
                task.cancel()
            await channel.close()


def _port_of(address: str) -> int:
    """The port of HOST:PORT, 0 for anything else (no address yet)."""
    try:
        return split_host_port(address)[1]
    except ValueError:
        return 0
