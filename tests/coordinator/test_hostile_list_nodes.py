"""Hostile input to ClientApi.ListNodes, which anyone can call: its request is one bool, so
what a caller can get wrong is the bytes themselves: an absurd number for the bool, unknown
fields (a megabyte of them), a message over the size limit, and a corrupt message.

Each is answered with the right status (or, for what protobuf defines as harmless, a normal
answer) and the coordinator goes on serving: the registered node is listed afterwards.
"""

from __future__ import annotations

import grpc
from support.coordinator_harness import Harness
from support.hostile import refused, unknown_field, varint

from protos import codec
from protos.tessera.v1 import client_api_pb2

METHOD = "/tessera.v1.ClientApi/ListNodes"


def _raw(harness: Harness) -> grpc.aio.UnaryUnaryMultiCallable:
    """ListNodes with the request bytes as given, not serialized by protobuf."""
    return harness.channel.unary_unary(
        METHOD,
        request_serializer=None,
        response_deserializer=client_api_pb2.ListNodesResponse.FromString,
    )


async def test_list_nodes_takes_odd_but_valid_bytes_and_refuses_oversized(
    harness: Harness,
) -> None:
    node = await harness.registered_node("lister")  # registered, not attached: offline
    raw = _raw(harness)
    # include_offline as the largest varint there is: any non-zero bool is true.
    absurd = b"\x08" + varint(2**64 - 1)
    assert [n.node_id for n in (await raw(absurd, timeout=10)).nodes] == [node.node_id]
    # A megabyte of unknown fields (with control characters) is ignored, as protobuf says.
    padded = unknown_field(99, b"\x00\r\n\x1b[2J" * 200_000) + b"\x08\x01"
    assert [n.node_id for n in (await raw(padded, timeout=10)).nodes] == [node.node_id]
    # Over the 64 MiB message limit: refused by gRPC before the coordinator sees it.
    oversized = unknown_field(99, b"x" * (codec.MAX_MESSAGE_BYTES + 10))
    await refused(raw(oversized, timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")

    # Still serving, through the ordinary stub too.
    api = harness.client_api
    assert list((await api.ListNodes(client_api_pb2.ListNodesRequest())).nodes) == []
    listed = await api.ListNodes(client_api_pb2.ListNodesRequest(include_offline=True))
    assert [(n.node_id, n.name) for n in listed.nodes] == [(node.node_id, "lister")]


async def test_a_corrupt_request_is_invalid_argument(harness: Harness) -> None:
    raw = _raw(harness)
    for corrupt in (b"\xff\xff\xff", b"\x0a\x05abc", b"\x08" + b"\xff" * 20):
        await refused(
            raw(corrupt, timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not a valid protobuf message",
        )
    # Still serving, and nothing was registered by the garbage.
    listed = await harness.client_api.ListNodes(client_api_pb2.ListNodesRequest())
    assert list(listed.nodes) == []
