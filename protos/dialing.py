"""The gRPC channel options every component dials another with."""

from __future__ import annotations

from protos import codec

MESSAGE_LIMITS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
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
