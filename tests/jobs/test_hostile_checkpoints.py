"""Hostile input to TrainingStore.DownloadCheckpoint, which any registered node can call:
huge, control-character and empty job ids, absurd step numbers (past SQLite's int64) and
layer ranges, a huge node id or a junk ticket in the metadata, and a message over the size
limit.

Each is refused with the right status and a short message (error details travel in gRPC
metadata, which a client refuses past 16 KiB), and the store goes on serving: the stage's
own node downloads its stored part intact afterwards.
"""

from __future__ import annotations

import hashlib

import grpc
from jobs.jobs_harness import JobsCoordinator, layers
from jobs.test_checkpoints import _advance, _chunks, _running_job, upload
from support.hostile import huge, refused

from protos import codec
from protos.tessera.v1 import training_pb2

HUGE = huge("j")


async def test_download_refuses_hostile_requests_briefly_and_keeps_serving(
    jc: JobsCoordinator,
) -> None:
    session = await _running_job(jc)
    await _advance(jc, session, 2)
    hop = session.hops[0]
    owner = jc.node(hop.node_id)
    data = b"state at step 2" * 100
    await upload(
        jc, _chunks(session.job_id, 2, hop.layers.start, hop.layers.end, data), owner.metadata
    )

    def download(metadata=owner.metadata, **fields):
        fields.setdefault("job_id", session.job_id)
        fields.setdefault("step", 2)
        fields.setdefault("layers", hop.layers)
        request = training_pb2.DownloadCheckpointRequest(**fields)
        return jc.store_stub.DownloadCheckpoint(request, metadata=metadata, timeout=10)

    details = await refused(download(job_id=HUGE), grpc.StatusCode.NOT_FOUND, "no job")
    assert "\x1b" not in details and "\n" not in details  # quoted, never raw
    await refused(download(job_id=""), grpc.StatusCode.NOT_FOUND, "no job")
    # Steps no checkpoint can have, up to past what SQLite stores (int64).
    for step in (0, 3, 2**63 - 1, 2**63, 2**64 - 1):
        await refused(
            download(step=step), grpc.StatusCode.NOT_FOUND, "the last consistent one is step"
        )
    for start, end in ((2**32 - 1, 2**32 - 1), (hop.layers.end, hop.layers.start)):
        await refused(
            download(layers=layers(start, end)), grpc.StatusCode.INVALID_ARGUMENT, "its stages are"
        )
    # A node id filling the metadata with the owner's ticket, and a junk ticket.
    stranger = (("x-tessera-node-id", "n" * 6000), ("x-tessera-ticket", owner.ticket.hex()))
    await refused(download(metadata=stranger), grpc.StatusCode.UNAUTHENTICATED, "register again")
    junk = (("x-tessera-node-id", owner.node_id), ("x-tessera-ticket", "zz" * 3000))
    await refused(download(metadata=junk), grpc.StatusCode.UNAUTHENTICATED, "ticket in hex")
    # Over the 64 MiB message limit: refused by gRPC before the store sees it.
    oversized = "x" * (codec.MAX_MESSAGE_BYTES + 10)
    await refused(download(job_id=oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")

    # Still serving: the owner gets its part, intact.
    chunks = [c async for c in download()]
    assert chunks[0].header.sha256 == hashlib.sha256(data).hexdigest()
    assert b"".join(c.data for c in chunks) == data
