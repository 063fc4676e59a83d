"""Hostile input on Coordinator.Attach, which any machine that registered can open: a hello
and a heartbeat over the size limit, a huge control-character node id and ticket, and on an
open stream a huge drain reason with control characters and a huge shard model name.

Each is refused with the right status and a short message (error details travel in gRPC
metadata, which a client refuses past 16 KiB), the node's own text is recorded and logged
quoted and cut short (never raw, so it cannot forge log lines), the node's registration is
kept, and the coordinator goes on serving: the same node attaches again and is acked.
"""

from __future__ import annotations

import logging

import grpc
import pytest
from support.coordinator_harness import Harness
from support.hostile import huge, refused

from coordinator.node_state import NodeState
from protos import codec
from protos.tessera.v1 import common_pb2, coordinator_pb2, node_pb2


class _Stream:
    """An Attach call that sends `messages` and is then read to its end (for `refused`)."""

    def __init__(self, call: grpc.aio.StreamStreamCall, *messages: object) -> None:
        self.call = call
        self.messages = messages

    async def __aiter__(self):
        for message in self.messages:
            await self.call.write(message)
        while (reply := await self.call.read()) is not grpc.aio.EOF:
            yield reply


def hello(node_id: str, ticket: bytes) -> coordinator_pb2.NodeMessage:
    return coordinator_pb2.NodeMessage(
        hello=coordinator_pb2.AttachHello(node_id=node_id, attach_ticket=ticket)
    )


async def test_attach_refuses_hostile_messages_and_keeps_the_node(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    node = await harness.registered_node("n1")
    stub = harness.coordinator_stub

    # Before hello: an oversized hello, and a huge id and ticket.
    oversized = "x" * (codec.MAX_MESSAGE_BYTES + 10)
    await refused(
        _Stream(stub.Attach(), hello(oversized, node.ticket)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "",
    )
    details = await refused(
        _Stream(stub.Attach(), hello(huge("n"), huge("t").encode())),
        grpc.StatusCode.NOT_FOUND,
        "call Register first",
    )
    assert "\x1b" not in details and "\n" not in details  # quoted, never raw
    await refused(
        _Stream(stub.Attach(), hello(node.node_id, huge("t").encode())),
        grpc.StatusCode.UNAUTHENTICATED,
        "register again",
    )
    assert harness.state(node.node_id) is NodeState.OFFLINE

    # On an open stream: a heartbeat over the limit ends that stream only.
    await node.attach()
    beat = coordinator_pb2.Heartbeat(seq=1)
    beat.telemetry.rtt_ms[oversized] = 1.0
    await refused(
        _Stream(node.call, coordinator_pb2.NodeMessage(heartbeat=beat)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "",
    )
    await harness.wait_state(node.node_id, NodeState.OFFLINE)

    # A huge drain reason with control characters: drained, the reason kept quoted and cut.
    await node.attach()
    caplog.set_level(logging.INFO)
    reason = huge("bye")
    await node.call.write(
        coordinator_pb2.NodeMessage(drain=coordinator_pb2.DrainRequest(reason=reason))
    )
    assert (await node.heartbeat(2)).heartbeat_ack.state == node_pb2.NODE_STATE_DRAINING
    harness.registry.flush()
    recorded = harness.registry.repo.events(node.node_id)[-1]
    assert recorded.to_state == "draining" and "bye" in recorded.reason
    assert len(recorded.reason) < 300
    assert not any(c in recorded.reason for c in "\x00\r\n\x1b")
    logged = [r.getMessage() for r in caplog.records if "bye" in r.getMessage()]
    assert logged and not any(c in m for m in logged for c in "\x00\r\n\x1b")

    # A huge shard model name: refused briefly, naming the field.
    status = node_pb2.ShardStatus(model=huge("m"), layers=common_pb2.LayerRange(start=0, end=1))
    await refused(
        _Stream(node.call, coordinator_pb2.NodeMessage(shard_status=status)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shard_status.model",
    )
    await harness.wait_state(node.node_id, NodeState.OFFLINE)

    # Still serving, registration kept: the same ticket attaches again, and the largest
    # sequence number there is comes back in the ack.
    await node.attach()
    ack = await node.heartbeat(2**64 - 1)
    assert ack.heartbeat_ack.seq == 2**64 - 1
    assert ack.heartbeat_ack.state == node_pb2.NODE_STATE_ONLINE
