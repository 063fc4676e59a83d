"""Hostile input to the node's TrainingStage: on SaveCheckpoint and CloseTraining huge,
control-character and empty job ids, absurd step numbers, a capability of garbage bytes,
closing a job never opened here, and messages over the size limit; on the compute calls
huge job ids, absurd step and micro-batch numbers and oversized gradients.

Each is refused with the right status and a short message (error details travel in gRPC
metadata, which a client refuses past 16 KiB), nothing reaches the checkpoint store, the
open job keeps its state, and the node goes on serving: a whole step, both stages'
checkpoints and the real close go through afterwards. The fixture (two real stage nodes
on loopback, the job open on both) is test_training_rpcs.py's.
"""

from __future__ import annotations

import grpc
import numpy as np
import torch
from data_plane.stage_harness import CoordinatorKeys
from support.hostile import huge, refused
from training.test_training_rpcs import (  # noqa: F401 - pair is a fixture
    JOB,
    Pair,
    backward,
    forward,
    full_step,
    pair,
    params_of,
    run_micro_batch,
    tokens_mb,
)
from training.training_harness import HIDDEN, training_capability

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
    await refused(save(job_id=oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
    await refused(close(job_id=oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")

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


async def test_compute_calls_refuse_hostile_ids_steps_and_oversized_gradients(
    pair: Pair,  # noqa: F811 - the fixture imported above
) -> None:
    """ForwardTrain, BackwardTrain, GradNorm and OptimizerStep with a huge control-character
    job id, absurd step and micro-batch numbers, and gradients larger than the micro-batch's
    output or than the node's per-micro-batch limit: each refused briefly, nothing applied,
    and the step then completes."""
    cap = pair.cap
    tokens, labels = tokens_mb(0)
    out = await pair.sa.ForwardTrain(forward(cap, codec.encode(tokens, "int64")))
    await pair.sb.ForwardTrain(forward(cap, out.output, labels=labels))
    grad = codec.decode((await pair.sb.BackwardTrain(backward(cap, None))).grad_input)
    batch, seq = grad.shape[:2]
    limit = pair.a.training.limits.max_tokens_per_micro_batch
    before = params_of(pair.a)

    def norm(job_id: str = JOB, step: int = 0) -> training_pb2.GradNormRequest:
        return training_pb2.GradNormRequest(capability=cap, job_id=job_id, step=step)

    def opt(job_id: str = JOB, step: int = 0) -> training_pb2.OptimizerStepRequest:
        return training_pb2.OptimizerStepRequest(
            capability=cap, job_id=job_id, step=step, clip_coef=1.0
        )

    hostile_ids = [
        pair.sa.ForwardTrain(forward(cap, codec.encode(tokens, "int64"), job=HUGE)),
        pair.sa.BackwardTrain(
            training_pb2.TrainBackwardRequest(capability=cap, job_id=HUGE, step=0)
        ),
        pair.sa.GradNorm(norm(job_id=HUGE)),
        pair.sa.OptimizerStep(opt(job_id=HUGE)),
    ]
    for call in hostile_ids:
        details = await refused(call, grpc.StatusCode.INVALID_ARGUMENT, "is not a job id")
        assert len(details) < 500 and "\x1b" not in details and "\n" not in details
    for call in (
        pair.sa.GradNorm(norm(step=2**64 - 1)),
        pair.sa.OptimizerStep(opt(step=2**64 - 1)),
    ):
        await refused(call, grpc.StatusCode.FAILED_PRECONDITION, "stale step")
    await refused(
        pair.sa.BackwardTrain(backward(cap, grad, mb=2**32 - 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "out of range",
    )
    # A gradient of more positions than the micro-batch ran forward, and one past the
    # node's limit on a micro-batch.
    await refused(
        pair.sa.BackwardTrain(backward(cap, np.zeros((batch, 2 * seq, HIDDEN)))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "grad_output is",
    )
    await refused(
        pair.sa.BackwardTrain(backward(cap, np.zeros((1, limit + 1, HIDDEN)))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "exceed the limit",
    )

    # Nothing was applied, and micro-batch 0 still waits for its gradient.
    assert all(torch.equal(before[n], after) for n, after in params_of(pair.a).items())
    assert pair.a.training._jobs[JOB].held.keys() == {0}
    # Still serving: the real gradient lands and the step completes on both stages.
    await pair.sa.BackwardTrain(backward(cap, grad))
    await run_micro_batch(pair, 1)
    for s in (pair.sa, pair.sb):
        assert (await s.GradNorm(norm())).finite
        assert (await s.OptimizerStep(opt())).step == 1
