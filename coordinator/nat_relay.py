"""The relay for nodes that clients cannot dial: TCP carried through a gRPC stream.

A node that the coordinator could not dial back at registration (behind NAT, a closed
port) opens `Relay.Tunnel` to the coordinator: it dials out, so NAT is no obstacle. The
relay then listens on `--relay-host` at a port of its own for that node, and every TCP
connection made there is carried, byte for byte, through the tunnel to the node's data
plane. So clients, other nodes (push hand-offs) and the verifier dial that address as if it
were the node's: gRPC, its TLS-free HTTP/2 and everything above run over it unchanged, and
the relay reads nothing of them. Placement gets the node with that address
(`SessionRpc.relayed`), so routes use it; a direct address is preferred once the node
answers there (coordinator/inference.py).

The node proves who it is with the attach ticket of its current registration. One tunnel
per node: a newer one replaces the older, and gets the older's port when it can (so a tunnel
that broke and came back keeps the node's address; with a range, also after a restart of
this relay, since the tunnel names its former port). With `--relay-ports LOW-HIGH` every
port comes from that range (the one range an operator opens in a firewall); without, the
system picks. It listens on `--relay-bind` (default: the relay host), for a host whose
public address is not on any of its interfaces (a cloud VM behind 1:1 NAT).

Limits: MAX_CONNECTIONS client connections per tunnel (MAX_CONNECTIONS_PER_ADDRESS from one
address, and a connection that sends nothing within FIRST_BYTES_TIMEOUT_S is closed, so a
stranger cannot hold all the places), MAX_DATA_BYTES a message, and towards the node a small
queue per connection (CONN_QUEUE_MESSAGES), so a client that sends faster than the tunnel
carries waits (TCP back-pressure) instead of filling memory. The tunnel takes from those
queues in turn, a message from each, so a client that floods delays another's request by
one message of its own, not by its whole backlog (_FairQueue). Towards the clients nothing
waits: one client that does not read must not hold up the node's other connections, so its
bytes are queued, and a client that leaves more than UNREAD_LIMIT bytes unread (or the one
with the most, when a tunnel's clients leave more than TUNNEL_UNREAD_LIMIT together) is cut
off (protos/tunnel_writes.py).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from coordinator.context import CoordinatorContext
from protos import tunnel_writes
from protos.quoting import shown
from protos.tessera.v1 import relay_pb2, relay_pb2_grpc

log = logging.getLogger("tessera.relay")

MAX_CONNECTIONS = 256
# One address may hold this many of a tunnel's connections (an honest client needs a few:
# the driver, its checks, other nodes' hand-offs come from their own addresses), so a
# stranger cannot take all MAX_CONNECTIONS and lock the node's clients out.
MAX_CONNECTIONS_PER_ADDRESS = 32
# A gRPC client sends its connection preface at once: a connection silent for this long
# only holds a place.
FIRST_BYTES_TIMEOUT_S = 10.0
MAX_DATA_BYTES = 1 << 20
READ_CHUNK = 64 * 1024
# Data messages waiting to go to the node, a connection: a few keep the tunnel busy while
# the client's next read is under way; more would only make the others wait longer (and
# cost memory: CONN_QUEUE_MESSAGES x READ_CHUNK x MAX_CONNECTIONS at most).
CONN_QUEUE_MESSAGES = 4
MAX_REMEMBERED = 10_000  # nodes whose last relay port is kept
UNREAD_LIMIT = tunnel_writes.MAX_UNREAD_BYTES  # a client connection's unread bytes
TUNNEL_UNREAD_LIMIT = 4 * UNREAD_LIMIT  # all of a tunnel's client connections together


class _FairQueue:
    """The messages towards the node, a queue for each connection, taken from them in
    turn: one connection's backlog never stands in front of another's bytes."""

    def __init__(self, per_conn: int) -> None:
        self._per_conn = per_conn
        # Each connection's messages in its order (open, data, close), and how many of them
        # are data: only data waits for room, so that a control message is never lost.
        self._queues: dict[int, deque[tuple[relay_pb2.TunnelDown, bool]]] = {}
        self._data: Counter[int] = Counter()
        self._turns: deque[int] = deque()  # the connections with something queued, in turn
        self._ready = asyncio.Event()  # something to get, or closed
        self._room: dict[int, asyncio.Event] = {}  # a put waits for its connection's room
        # Connections whose close is queued: data that was waiting for room then would
        # follow the close, so it is dropped (the node has no connection to give it to).
        self._ending: set[int] = set()
        self._closed = False

    def conns(self) -> set[int]:
        """The connections with messages still to send (each holds memory)."""
        return set(self._queues)

    async def put(self, conn: int, message: relay_pb2.TunnelDown) -> None:
        """Queue a data message once ``conn`` has room: only that connection waits."""
        while self._data[conn] >= self._per_conn and not self._dropping(conn):
            room = self._room.setdefault(conn, asyncio.Event())
            room.clear()
            await room.wait()
        if self._dropping(conn):
            return
        self._data[conn] += 1
        self._append(conn, message, is_data=True)

    def _dropping(self, conn: int) -> bool:
        return self._closed or conn in self._ending

    def put_control(self, conn: int, message: relay_pb2.TunnelDown) -> None:
        """Queue an open or a close at once, behind ``conn``'s data: waiting could lose it
        (a caller that cannot wait) and going first would reorder it."""
        if self._closed:
            return  # the node is gone: nowhere to send it
        if message.HasField("close"):
            self._ending.add(conn)
            self._wake(conn)  # a put waiting for room drops its data now
        self._append(conn, message, is_data=False)

    def _append(self, conn: int, message: relay_pb2.TunnelDown, *, is_data: bool) -> None:
        queue = self._queues.get(conn)
        if queue is None:
            queue = self._queues[conn] = deque()
            self._turns.append(conn)
        queue.append((message, is_data))
        self._ready.set()

    def _wake(self, conn: int) -> None:
        room = self._room.pop(conn, None)
        if room is not None:
            room.set()

    async def get(self) -> relay_pb2.TunnelDown | None:
        """The next message, one from each waiting connection in turn; None once closed."""
        while not self._turns and not self._closed:
            self._ready.clear()
            await self._ready.wait()
        if self._closed:
            return None
        conn = self._turns.popleft()
        queue = self._queues[conn]
        message, is_data = queue.popleft()
        if is_data:
            self._data[conn] -= 1
            self._wake(conn)
        if queue:
            self._turns.append(conn)  # its next message waits for the others' turns
        else:  # ids are never reused: forget the connection (memory stays bounded)
            del self._queues[conn]
            del self._data[conn]
            self._ending.discard(conn)
        return message

    def close(self) -> None:
        """Drop what was not sent; get() gives None from now on, and no put() waits."""
        self._closed = True
        self._queues.clear()
        self._data.clear()
        self._turns.clear()
        self._ending.clear()
        self._ready.set()
        for room in self._room.values():
            room.set()
        self._room.clear()


class _Tunnel:
    """One node's tunnel: its public listener and the client connections on it."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.down = _FairQueue(CONN_QUEUE_MESSAGES)
        self.conns: dict[int, asyncio.StreamWriter] = {}
        self.server: asyncio.base_events.Server | None = None
        self._ids = itertools.count(1)
        self._per_address: Counter[str] = Counter()  # open connections by client address
        self.closed = False

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        refusal = self._refusal(address)
        if refusal:
            log.warning("relay for %s: %s; refusing a connection from %s", self.node_id,
                        refusal, address)  # fmt: skip
            writer.close()
            return
        conn = next(self._ids)
        self.conns[conn] = writer
        self._per_address[address] += 1
        self.down.put_control(conn, relay_pb2.TunnelDown(open=relay_pb2.TunnelOpen(conn=conn)))
        try:
            timeout_s: float | None = FIRST_BYTES_TIMEOUT_S
            while chunk := await asyncio.wait_for(reader.read(READ_CHUNK), timeout_s):
                timeout_s = None
                if conn not in self.conns:
                    break  # cut off, and the node told so: nothing may follow the close
                await self.down.put(
                    conn, relay_pb2.TunnelDown(data=relay_pb2.TunnelData(conn=conn, data=chunk))
                )
        except TimeoutError:
            log.info("relay for %s: connection %d from %s sent nothing in %.0f s; closed",
                     self.node_id, conn, address, FIRST_BYTES_TIMEOUT_S)  # fmt: skip
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._per_address[address] -= 1
            if not self._per_address[address]:
                del self._per_address[address]
            if self.conns.pop(conn, None) is not None:  # the client ended it: tell the node
                writer.close()
                self._tell_closed(conn)

    def _refusal(self, address: str) -> str:
        """Why a new connection from ``address`` is not taken, or ""."""
        # A connection that ended holds its place until its last bytes are sent: else
        # clients that open, send and leave could pile up queues while the node is slow.
        if len(self.conns.keys() | self.down.conns()) >= MAX_CONNECTIONS:
            return f"{MAX_CONNECTIONS} connections open or still sending to the node"
        if self._per_address[address] >= MAX_CONNECTIONS_PER_ADDRESS:
            return f"{MAX_CONNECTIONS_PER_ADDRESS} connections open from that address"
        return ""

    def deliver(self, data: relay_pb2.TunnelData) -> None:
        """The node's bytes to their client, queued without waiting for it to read."""
        writer = self.conns.get(data.conn)
        if writer is None:
            return  # the client left meanwhile: its close is on the way to the node
        if not tunnel_writes.write_or_cut(writer, data.data, UNREAD_LIMIT):
            self._cut(data.conn, f"its client left more than {UNREAD_LIMIT} bytes unread")
            return
        if not tunnel_writes.unread_bytes(writer):
            return  # taken at once (the usual case): the tunnel's total did not grow
        unread = {c: tunnel_writes.unread_bytes(w) for c, w in self.conns.items()}
        if sum(unread.values()) > TUNNEL_UNREAD_LIMIT:
            hog = max(unread, key=unread.__getitem__)
            tunnel_writes.cut(self.conns[hog])
            self._cut(hog, f"the tunnel's clients left more than {TUNNEL_UNREAD_LIMIT} bytes "
                           f"unread, this one {unread[hog]}")  # fmt: skip

    def _cut(self, conn: int, why: str) -> None:
        log.warning("relay for %s: connection %d cut off (%s); the node's other connections "
                    "go on", self.node_id, conn, why)  # fmt: skip
        del self.conns[conn]
        self._tell_closed(conn)

    def _tell_closed(self, conn: int) -> None:
        """The node closes its end too, after the connection's queued data; never lost (the
        node would keep a connection to its data plane open for nothing)."""
        if self.closed:
            return  # the stream to the node has ended
        self.down.put_control(conn, relay_pb2.TunnelDown(close=relay_pb2.TunnelClose(conn=conn)))

    def drop(self, conn: int) -> None:
        """The node ended the connection: the client gets what is queued, then the close."""
        writer = self.conns.pop(conn, None)
        if writer is not None:
            writer.close()

    async def close(self) -> None:
        self.closed = True
        if self.server is not None:
            self.server.close()
        for writer in self.conns.values():
            tunnel_writes.cut(writer)  # the node is gone: nothing queued can be answered
        self.conns.clear()
        # What the node has not been sent yet goes nowhere now; get() gives None, which
        # ends the stream.
        self.down.close()


class NatRelay(relay_pb2_grpc.RelayServicer):
    """`Relay.Tunnel`: relayed nodes' addresses are on `host` (None: no relay here), their
    ports listen on `bind` (default `host`), within `ports` (LOW, HIGH) when given."""

    def __init__(
        self,
        host: str | None,
        check_ticket: Callable[[str, bytes], bool],
        on_relayed: Callable[[str, str], None] = lambda node_id, address: None,
        on_unrelayed: Callable[[str], None] = lambda node_id: None,
        *,
        bind: str | None = None,
        ports: tuple[int, int] | None = None,
    ) -> None:
        self.host = host
        self._bind = bind or host
        self._ports = ports
        self._check_ticket = check_ticket
        self._on_relayed = on_relayed
        self._on_unrelayed = on_unrelayed
        self._tunnels: dict[str, _Tunnel] = {}
        # The port each node's tunnel last had, tried first when it opens one again. The
        # newest MAX_REMEMBERED nodes only.
        self._last_port: dict[str, int] = {}
        self._next_in_range = 0  # where the next scan of the range starts

    def add_to_server(self, server: grpc.aio.Server) -> None:
        relay_pb2_grpc.add_RelayServicer_to_server(self, server)

    async def stop(self) -> None:
        for tunnel in list(self._tunnels.values()):
            await tunnel.close()

    async def Tunnel(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[relay_pb2.TunnelUp], context: Any
    ) -> AsyncIterator[relay_pb2.TunnelDown]:
        if self.host is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this coordinator runs no relay (start it with --relay-host HOST, the address "
                "clients reach it at); open this node's data-plane port instead",
            )
        hello = await _first(request_iterator, context)
        node_id = hello.node_id
        if not self._check_ticket(node_id, hello.attach_ticket):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"node {shown(node_id)} has no registration with that attach ticket; register "
                "again, then open the tunnel",
            )
        tunnel = _Tunnel(node_id)
        older = self._tunnels.pop(node_id, None)
        if older is not None:  # replaced: its port is free for this one
            await older.close()
        try:
            tunnel.server = await self._listen(tunnel, node_id, hello.previous_port)
        except (_NoPort, OSError) as err:
            if older is not None:  # the node had a tunnel, and now has none
                self._on_unrelayed(node_id)
            if isinstance(err, _NoPort):
                log.warning("relay: no port for node %s: %s", node_id, err)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
            log.error("relay: cannot listen on %s: %s", self._bind, err)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the relay cannot open a port right now; try again"
            )
        port = tunnel.server.sockets[0].getsockname()[1]
        address = f"{self.host}:{port}"
        self._tunnels[node_id] = tunnel
        self._last_port.pop(node_id, None)
        self._last_port[node_id] = port
        while len(self._last_port) > MAX_REMEMBERED:
            del self._last_port[next(iter(self._last_port))]
        reading = asyncio.ensure_future(self._read(request_iterator, tunnel))
        log.info("relay: node %s is reachable at %s through its tunnel", node_id, address)
        try:
            # Routed through the tunnel before the node hears of it: whoever the node tells
            # its address then finds it known here (clients' bytes wait in the queues).
            self._on_relayed(node_id, address)
            yield relay_pb2.TunnelDown(welcome=relay_pb2.TunnelWelcome(address=address))
            while (message := await tunnel.down.get()) is not None:
                yield message
            problem = reading.exception() if reading.done() and not reading.cancelled() else None
            if isinstance(problem, _BadMessage):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(problem))
        finally:
            reading.cancel()
            await tunnel.close()
            if self._tunnels.get(node_id) is tunnel:
                del self._tunnels[node_id]
                self._on_unrelayed(node_id)
                log.info("relay: the tunnel of node %s closed", node_id)

    async def _listen(
        self, tunnel: _Tunnel, node_id: str, previous_port: int
    ) -> asyncio.base_events.Server:
        """A listener for this node's tunnel: at the port its last tunnel had if that is
        free (as this relay remembers it, or within the range as the node says it), else
        the next free one of the range (or one the system picks)."""
        taken = {t.port for t in self._tunnels.values()}
        candidates: list[int] = []
        last = self._last_port.get(node_id)
        if last is None and self._ports is not None:
            low, high = self._ports
            last = previous_port if low <= previous_port <= high else None
        if last is not None and last not in taken:
            candidates.append(last)
        if self._ports is None:
            candidates.append(0)
        else:
            low, high = self._ports
            size = high - low + 1
            start = self._next_in_range % size
            candidates.extend(low + (start + i) % size for i in range(size))
        for port in candidates:
            if port in taken:
                continue
            try:
                server = await asyncio.start_server(tunnel.accept, self._bind, port)
            except OSError as err:
                if port != last and (port == 0 or err.errno != errno.EADDRINUSE):
                    raise
                continue  # another program has it
            if self._ports is not None and port != last:
                self._next_in_range = port - self._ports[0] + 1
            return server
        assert self._ports is not None  # port 0 never runs out
        low, high = self._ports
        raise _NoPort(
            f"all {high - low + 1} relay ports ({low}-{high}) are in use: this coordinator "
            "relays no more nodes until one leaves (its operator can widen --relay-ports); "
            "or open this node's data-plane port to clients"
        )

    async def _read(
        self, request_iterator: AsyncIterator[relay_pb2.TunnelUp], tunnel: _Tunnel
    ) -> None:
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "data":
                    if len(message.data.data) > MAX_DATA_BYTES:
                        raise _BadMessage(
                            f"a tunnel message carries at most {MAX_DATA_BYTES} bytes, got "
                            f"{len(message.data.data)}"
                        )
                    tunnel.deliver(message.data)
                elif kind == "close":
                    tunnel.drop(message.close.conn)
                else:
                    raise _BadMessage(
                        f"after the hello a tunnel carries data and close messages, got "
                        f"{kind or 'an empty message'}"
                    )
        finally:
            await tunnel.close()


class _BadMessage(Exception):
    pass


class _NoPort(Exception):
    pass


async def _first(
    request_iterator: AsyncIterator[relay_pb2.TunnelUp], context: Any
) -> relay_pb2.TunnelHello:
    try:
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            first = await anext(aiter(request_iterator), None)
    except TimeoutError:
        first = None
    if first is None or first.WhichOneof("kind") != "hello" or not first.hello.node_id:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "the first message on a tunnel must be hello{node_id, attach_ticket}",
        )
    return first.hello  # type: ignore[union-attr]


HELLO_TIMEOUT_S = 10.0


def build(ctx: CoordinatorContext) -> NatRelay:
    sessions = ctx.sessions
    return NatRelay(
        ctx.settings.relay_host,
        ctx.registry.check_ticket,
        on_relayed=sessions.relayed if sessions is not None else (lambda n, a: None),
        on_unrelayed=sessions.unrelayed if sessions is not None else (lambda n: None),
        bind=ctx.settings.relay_bind,
        ports=ctx.settings.relay_ports,
    )
