"""Hostile input to the node's TrainingStage.SaveCheckpoint and CloseTraining: huge,
control-character and empty job ids, absurd step numbers, a capability of garbage bytes,
closing a job never opened here, and messages over the size limit.

Each is refused with the right status and a short message (error details travel in gRPC
metadata, which a client refuses past 16 KiB), nothing reaches the checkpoint store, the
open job keeps its state, and the node goes on serving: a whole step, both stages'
checkpoints and the real close go through afterwards. The fixture (two real stage nodes
on loopback, the job open on both) is test_training_rpcs.py's.
"""

from __future__ import annotations

import grpc
from data_plane.stage_harness import CoordinatorKeys
from support.hostile import huge, refused
from training.test_training_rpcs import JOB, Pair, full_step, pair  # noqa: F401 - fixture
from training.training_harness import training_capability

from protos import codec
from protos.tessera.v1 import client_api_pb2, common_pb2, training_pb2

HUGE = huge("job")


async def test_save_and_close_refuse_hostile_input_and_keep_the_job(
    pair: Pair,  # noqa: F811 - the fixture imported above
    store,
    keys: CoordinatorKeys,
) -> None:
    await full_step(pair, 0)
    cap = pair.cap
    garbage = client_api_pb2.SignedCapability(claims=HUGE.encode(), signature=b"\xff" * 64)
    unopened = training_capability(keys, "job-2", [(pair.a, 0, 2)])

    def save(job_id: str = JOB, step: int = 1, capability=cap):
        request = training_pb2.SaveCheckpointRequest(
            capability=capability, job_id=job_id, step=step
        )
        return pair.sa.SaveCheckpoint(request, timeout=10)

    def close(job_id: str = JOB, capability=cap):
        request = training_pb2.CloseTrainingRequest(capability=capability, job_id=job_id)
        return pair.sa.CloseTraining(request, timeout=10)

    for call in (save, close):
        for job_id in (HUGE, ""):
            details = await refused(
                call(job_id=job_id), grpc.StatusCode.INVALID_ARGUMENT, "is not a job id"
            )
            assert "\x1b" not in details and "\n" not in details  # quoted, never raw
        await refused(call(capability=garbage), grpc.StatusCode.UNAUTHENTICATED, "does not verify")
        await refused(
            call(job_id="job-2", capability=unopened), grpc.StatusCode.NOT_FOUND, "OpenTraining"
        )
    for step in (0, 2, 2**64 - 1):
        await refused(save(step=step), grpc.StatusCode.FAILED_PRECONDITION, "stale step")
    # Over the 64 MiB message limit: refused by gRPC before the servicer sees it.
    oversized = "x" * (codec.MAX_MESSAGE_BYTES + 10)
    await refused(save(job_id=oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "")
    await refused(close(job_id=oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "")

    # Nothing was uploaded or closed: the job is open at version 1 on both nodes.
    assert store.stored == {}
    for node in (pair.a, pair.b):
        assert node.training._jobs[JOB].trainer.version == 1

    # Still serving: a step, both stages' checkpoints, and the real close.
    await full_step(pair, 1)
    saved = [
        await s.SaveCheckpoint(
            training_pb2.SaveCheckpointRequest(capability=cap, job_id=JOB, step=2)
        )
        for s in (pair.sa, pair.sb)
    ]
    assert [r.consistent for r in saved] == [False, True]
    assert await close() == common_pb2.Empty()
    assert JOB not in pair.a.training._jobs and JOB in pair.b.training._jobs
