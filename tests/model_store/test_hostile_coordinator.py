"""Hostile input to the Coordinator service's model RPCs, GetManifest and FetchTensors.

Any machine can register as a node, so a registered node's calls are untrusted input:
huge and control-character model names and digests, a huge node id in the metadata, and
messages over the size limit. Each is refused with the right status and a short message
(error details travel in gRPC metadata, which a client refuses past 16 KiB: a message
that repeats a huge name arrives as RESOURCE_EXHAUSTED "Stream removed" instead of the
real reason), and the store goes on serving the same node.
"""

from __future__ import annotations

import grpc
import pytest
from support.coordinator_harness import CHANNEL_OPTIONS
from support.hostile import huge, refused

from protos import codec
from protos.tessera.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

HUGE_NAME = huge("tiny")


@pytest.fixture
async def served_model(store_server, tiny_checkpoint, upload_chunks):
    await store_server.add_model(upload_chunks(tiny_checkpoint, "tiny"))
    return store_server


async def test_manifest_and_fetch_refuse_hostile_names_and_digests_briefly(served_model) -> None:
    node = await served_model.register_node()
    meta = (("x-tessera-node-id", node.node_id), ("x-tessera-ticket", node.ticket.hex()))
    async with grpc.aio.insecure_channel(served_model.address, options=CHANNEL_OPTIONS) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)

        def manifest(name: str):
            return stub.GetManifest(common_pb2.ModelRef(name=name), metadata=meta, timeout=10)

        def fetch(model: str, digests: list[str]):
            request = coordinator_pb2.FetchRequest(model=model, sha256=digests)
            return stub.FetchTensors(request, metadata=meta, timeout=10)

        details = await refused(manifest(HUGE_NAME), grpc.StatusCode.NOT_FOUND, "tiny")
        assert "\x1b" not in details and "\n" not in details  # quoted, never raw
        await refused(manifest(""), grpc.StatusCode.NOT_FOUND, "known models: tiny")
        await refused(fetch(HUGE_NAME, ["0" * 64]), grpc.StatusCode.NOT_FOUND, "tiny")
        hostile_digests = [HUGE_NAME, "\n" * 50_000, "f" * 65]
        await refused(
            fetch("tiny", hostile_digests), grpc.StatusCode.INVALID_ARGUMENT, "not sha256"
        )
        # A node id that fills the metadata, with a valid ticket: unknown, said briefly.
        stranger = (("x-tessera-node-id", "n" * 6000), ("x-tessera-ticket", node.ticket.hex()))
        await refused(
            stub.GetManifest(common_pb2.ModelRef(name="tiny"), metadata=stranger),
            grpc.StatusCode.UNAUTHENTICATED,
            "register again",
        )
        # Over the 64 MiB message limit: refused by gRPC before the store sees it.
        oversized = "x" * (codec.MAX_MESSAGE_BYTES + 10)
        await refused(manifest(oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")

        # The same node still gets its manifest and a tensor.
        listed = await manifest("tiny")
        entry = listed.tensors[0]
        chunks = [c async for c in fetch("tiny", [entry.sha256])]
        assert sum(len(c.data) for c in chunks) == entry.nbytes
