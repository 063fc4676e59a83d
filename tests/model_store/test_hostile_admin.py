"""Hostile input to Admin.RemoveModel: missing, wrong and huge admin tokens, huge,
control-character, empty and look-alike model names, and a message over the size limit.

Each is refused with the right status and a short message (error details travel in gRPC
metadata, which a client refuses past 16 KiB: a message that repeats a huge name arrives
as RESOURCE_EXHAUSTED "Stream removed" instead of the real reason), no model or blob is
lost, and the store goes on serving: the model is still listed and fetched, and its real
removal afterwards goes through.
"""

from __future__ import annotations

import grpc
from support.coordinator_harness import CHANNEL_OPTIONS
from support.hostile import huge, refused

from coordinator.admin_auth import bearer_metadata
from protos import codec
from protos.tessera.v1 import admin_pb2_grpc, common_pb2

HUGE_NAME = huge("tiny")


async def test_remove_model_refuses_hostile_input_and_keeps_the_model(
    store_server, tiny_checkpoint, upload_chunks
) -> None:
    await store_server.add_model(upload_chunks(tiny_checkpoint, "tiny"))
    blobs = store_server.blob_files()
    auth = store_server.auth
    # Twice the size limit on sends, so the oversized message reaches the server.
    async with grpc.aio.insecure_channel(store_server.address, options=CHANNEL_OPTIONS) as ch:
        admin = admin_pb2_grpc.AdminStub(ch)

        def remove(name: str, metadata: tuple[tuple[str, str], ...] = auth):
            return admin.RemoveModel(common_pb2.ModelRef(name=name), metadata=metadata, timeout=10)

        # Credentials come first: none, wrong, and a huge guess all say what to send.
        await refused(remove("tiny", ()), grpc.StatusCode.UNAUTHENTICATED, "admin.token")
        await refused(
            remove("tiny", bearer_metadata("guess")), grpc.StatusCode.UNAUTHENTICATED, "wrong"
        )
        await refused(
            remove("tiny", bearer_metadata("g" * 6000)), grpc.StatusCode.UNAUTHENTICATED, "wrong"
        )
        await refused(
            remove("tiny", (("authorization", "Basic " + "a" * 100),)),
            grpc.StatusCode.UNAUTHENTICATED,
            "Bearer <token>",
        )
        # Unknown names, quoted and cut short, with the names that do exist.
        details = await refused(remove(HUGE_NAME), grpc.StatusCode.NOT_FOUND, "known models: tiny")
        assert "\x1b" not in details and "\n" not in details  # quoted, never raw
        await refused(remove(""), grpc.StatusCode.NOT_FOUND, "known models: tiny")
        # Look-alikes (a SQL wildcard, case, padding) remove nothing.
        for name in ("%", "tin%", "TINY", " tiny", "tiny\x00"):
            await refused(remove(name), grpc.StatusCode.NOT_FOUND, "known models: tiny")
        # Over the 64 MiB message limit: refused by gRPC before the store sees it.
        oversized = "x" * (codec.MAX_MESSAGE_BYTES + 10)
        await refused(remove(oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")

        # Nothing was lost: the model is listed, fetchable, and its blobs are on disk.
        assert store_server.blob_files() == blobs
        listed = await store_server.client_api.ListModels(common_pb2.Empty())
        assert [m.name for m in listed.models] == ["tiny"]
        detail = await store_server.client_api.GetModel(common_pb2.ModelRef(name="tiny"))
        assert detail.info.num_layers == 3

        # Still serving: the real removal goes through and frees the blobs.
        assert await remove("tiny") == common_pb2.Empty()
    assert store_server.blob_files() == []
    assert list((await store_server.client_api.ListModels(common_pb2.Empty())).models) == []
