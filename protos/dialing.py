"""The gRPC options every component dials another with, and the data plane's window."""

from __future__ import annotations

from protos import codec

MESSAGE_LIMITS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
]

# A 512-token prefill chunk of hidden size 4096 in float32 is 8 MiB.
DATA_WINDOW_BYTES = 8 << 20
# gRPC sizes its receive window with a ping (BDP probe) when data arrives: on a decode
# stream that is frames and thread wake-ups beside nearly every reply. A fixed window as
# large as a prefill chunk's hidden states keeps big messages flowing without it (on
# loopback a 4 KiB round trip measured ~15% faster; 2 MiB ones alike within noise). For
# both ends of every data-plane stream: client, node server, node-to-node relay links.
DATA_WINDOW: list[tuple[str, int]] = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", DATA_WINDOW_BYTES),
]

# By default gRPC shares one connection per (address, options) among all the channels of
# a process, and with it the reconnect backoff of a failed one (up to two minutes). A new
# channel to a node that came up at the address of a dead one (a node restarted on its
# --listen port, or a new one given a recycled ephemeral port) then fails at once with
# "Connection refused" while any older channel to the dead node is still open. With a
# local pool, every channel dials for itself.
DIAL_OPTIONS: list[tuple[str, int]] = [
    *MESSAGE_LIMITS,
    ("grpc.use_local_subchannel_pool", 1),
]


def dialable(address: str) -> bool:
    """True for HOST:PORT as gRPC dials it meant (port 1-65535, no scheme). gRPC itself
    reads "localhost" as port 443 and "http://host:7000" as a host name, then fails with a
    resolver message that names neither mistake; every CLI checks with this first."""
    host, sep, port = address.rpartition(":")
    return "://" not in address and bool(sep and host) and port.isdigit() and 0 < int(port) <= 65535
