"""The states a node can be in, and how they map to the wire."""

from __future__ import annotations

import enum

from protos.tessera.v1 import node_pb2


class NodeState(str, enum.Enum):  # noqa: UP042 - keeps the str-mixin semantics it was tested with
    ONLINE = "online"
    SUSPECT = "suspect"  # missed heartbeats, not yet given up on
    OFFLINE = "offline"
    DRAINING = "draining"  # no new work; finishing what runs
    BANNED = "banned"

    def to_proto(self) -> int:
        return _TO_PROTO[self]


_TO_PROTO = {
    NodeState.ONLINE: node_pb2.NODE_STATE_ONLINE,
    NodeState.SUSPECT: node_pb2.NODE_STATE_SUSPECT,
    NodeState.OFFLINE: node_pb2.NODE_STATE_OFFLINE,
    NodeState.DRAINING: node_pb2.NODE_STATE_DRAINING,
    NodeState.BANNED: node_pb2.NODE_STATE_BANNED,
}

# Why every connected node goes offline when the coordinator stops, and why whoever was
# still connected is marked offline when it starts again (after a crash): the
# coordinator's outages, which coordinator/reliability.py does not count against nodes.
SHUTDOWN_REASON = "the coordinator is shutting down"
RESTART_REASON = "coordinator restarted"

# States in which a node is connected and may be given work (draining: only finish work).
CONNECTED = frozenset({NodeState.ONLINE, NodeState.SUSPECT, NodeState.DRAINING})
