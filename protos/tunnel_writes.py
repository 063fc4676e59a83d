"""Writing one of a tunnel's connections without waiting for its reader.

The relay (coordinator/nat_relay.py) and a relayed node (node_agent/nat_tunnel.py) carry
many TCP connections over one gRPC stream, read by one loop at each end. If that loop
waited for a connection's reader (``drain``), a client that stops reading would hold up
every other connection of the node: a stranger could freeze a relayed node by calling it
and never reading the answers. So the loop queues the bytes and goes on; a connection
whose unread bytes pass a limit is cut instead.

gRPC's own flow control bounds what an honest peer leaves unread to its receive windows:
a stream's is ``protos.dialing.DATA_WINDOW_BYTES`` (8 MiB), so the limit leaves room for a
few streams of one connection at full window.
"""

from __future__ import annotations

import asyncio

MAX_UNREAD_BYTES = 32 << 20


def unread_bytes(writer: asyncio.StreamWriter) -> int:
    """Bytes queued on ``writer`` that its peer has not taken yet (beyond the kernel's)."""
    transport = writer.transport
    return 0 if transport.is_closing() else transport.get_write_buffer_size()


def write_or_cut(writer: asyncio.StreamWriter, data: bytes, limit: int) -> bool:
    """Queue ``data`` on ``writer`` without waiting; False, with the connection cut at
    once (its queued bytes dropped), when its peer has left more than ``limit`` bytes
    unread. A connection already closing takes nothing (and is not counted as cut)."""
    if writer.transport.is_closing():
        return True  # its end is already on the way to the other side
    writer.write(data)
    if unread_bytes(writer) <= limit:
        return True
    cut(writer)
    return False


def cut(writer: asyncio.StreamWriter) -> None:
    """Close now, dropping what is queued: a graceful close would wait for a reader that
    does not read."""
    writer.transport.abort()
