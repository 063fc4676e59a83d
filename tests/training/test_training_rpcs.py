"""TrainingStage RPCs over real gRPC: malformed, oversized and hostile input on every call.

Two real stage servers on loopback: node A trains layers [0, 2) (token ids in), node B
layers [2, 4) (hidden states in, labels and loss out). Every refusal must carry the right
status code and a message that says what to do, leave the job's state unchanged, and leave
the node serving. Checkpoints go to ``StandInTrainingStore`` (tests/training/
training_harness.py), which stands in for the coordinator's TrainingStore.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from data_plane.stage_harness import CoordinatorKeys
from training.training_harness import (
    HIDDEN,
    MODEL,
    VOCAB,
    TrainingNode,
    counting_batch,
    hyper,
    training_capability,
)

from node_agent import checkpoint_client
from node_agent.runtime import load_model_config
from node_agent.runtime.training import training_memory
from node_agent.training_server import TrainingLimits
from protos import codec
from protos.tessera.v1 import common_pb2, training_pb2, training_pb2_grpc

JOB = "job-1"


@dataclass
class Pair:
    """Nodes A [0, 2) and B [2, 4), a capability for both, stubs, and the job opened."""

    a: TrainingNode
    b: TrainingNode
    cap: Any
    sa: training_pb2_grpc.TrainingStageStub
    sb: training_pb2_grpc.TrainingStageStub
    channels: list[grpc.aio.Channel]


def stub(node: TrainingNode) -> tuple[training_pb2_grpc.TrainingStageStub, grpc.aio.Channel]:
    channel = grpc.aio.insecure_channel(node.address)
    return training_pb2_grpc.TrainingStageStub(channel), channel


def open_request(cap: Any, start: int, end: int, **fields: Any) -> training_pb2.OpenTrainingRequest:
    values: dict[str, Any] = {
        "capability": cap,
        "job_id": JOB,
        "model": MODEL,
        "layers": common_pb2.LayerRange(start=start, end=end),
        "hyper": hyper("full"),
    }
    values.update(fields)
    return training_pb2.OpenTrainingRequest(**values)


@pytest.fixture
async def pair(start_node, keys: CoordinatorKeys, store) -> Pair:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)])
    cap = training_capability(keys, JOB, [(a, 0, 2), (b, 2, 4)])
    store.stages[JOB] = {(0, 2), (2, 4)}
    sa, ca = stub(a)
    sb, cb = stub(b)
    assert (await sa.OpenTraining(open_request(cap, 0, 2))).step == 0
    assert (await sb.OpenTraining(open_request(cap, 2, 4))).step == 0
    yield Pair(a, b, cap, sa, sb, [ca, cb])
    for channel in (ca, cb):
        await channel.close()


async def refused(call: Any, code: grpc.StatusCode, *words: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    details = info.value.details()
    for word in words:
        assert word in details, details
    return details


def forward(
    cap: Any,
    x: common_pb2.Tensor | None,
    *,
    step: int = 0,
    mb: int = 0,
    labels: np.ndarray | None = None,
    job: str = JOB,
) -> training_pb2.TrainForwardRequest:
    request = training_pb2.TrainForwardRequest(
        capability=cap, job_id=job, step=step, micro_batch=mb
    )
    if x is not None:
        request.input.CopyFrom(x)
    if labels is not None:
        request.labels.CopyFrom(codec.encode(labels, "int64"))
    return request


def backward(
    cap: Any, grad: np.ndarray | common_pb2.Tensor | None, *, step: int = 0, mb: int = 0
) -> training_pb2.TrainBackwardRequest:
    request = training_pb2.TrainBackwardRequest(
        capability=cap, job_id=JOB, step=step, micro_batch=mb
    )
    if isinstance(grad, np.ndarray):
        request.grad_output.CopyFrom(codec.encode(grad.astype(np.float32), "float32"))
    elif grad is not None:
        request.grad_output.CopyFrom(grad)
    return request


def tokens_mb(mb: int) -> tuple[np.ndarray, np.ndarray]:
    tokens, labels = counting_batch(0)
    return tokens[2 * mb : 2 * mb + 2], labels[2 * mb : 2 * mb + 2]


async def run_micro_batch(p: Pair, mb: int, *, step: int = 0) -> float:
    """Forward and backward one micro-batch of the counting task through A and B."""
    tokens, labels = tokens_mb(mb)
    out = await p.sa.ForwardTrain(forward(p.cap, codec.encode(tokens, "int64"), step=step, mb=mb))
    loss = await p.sb.ForwardTrain(forward(p.cap, out.output, step=step, mb=mb, labels=labels))
    back = await p.sb.BackwardTrain(backward(p.cap, None, step=step, mb=mb))
    await p.sa.BackwardTrain(backward(p.cap, back.grad_input, step=step, mb=mb))
    return loss.loss


async def full_step(p: Pair, step: int) -> list[float]:
    losses = [await run_micro_batch(p, mb, step=step) for mb in range(2)]
    norms = [
        await s.GradNorm(training_pb2.GradNormRequest(capability=p.cap, job_id=JOB, step=step))
        for s in (p.sa, p.sb)
    ]
    assert all(n.finite for n in norms)
    for s in (p.sa, p.sb):
        reply = await s.OptimizerStep(
            training_pb2.OptimizerStepRequest(
                capability=p.cap, job_id=JOB, step=step, clip_coef=1.0
            )
        )
        assert reply.step == step + 1
    return losses


def params_of(node: TrainingNode) -> dict[str, torch.Tensor]:
    trainer = node.training._jobs[JOB].trainer
    return {n: t.detach().clone() for n, t in trainer.trainable_parameters().items()}


# ---- capability --------------------------------------------------------------------------


async def test_capability_is_checked_on_every_rpc(pair: Pair, keys: CoordinatorKeys) -> None:
    forged = CoordinatorKeys().capability(JOB, [(pair.a.node_id, 0, 2)], model=MODEL)
    expired = training_capability(keys, JOB, [(pair.a, 0, 2)], ttl_s=-1)
    other_job = training_capability(keys, "job-2", [(pair.a, 0, 2)])
    not_me = training_capability(keys, JOB, [(pair.b, 0, 2)])
    narrow = training_capability(keys, JOB, [(pair.a, 0, 1)])
    other_model = keys.capability(JOB, [(pair.a.node_id, 0, 2)], model="other")
    x = codec.encode(tokens_mb(0)[0], "int64")
    calls = {
        "open": lambda cap: pair.sa.OpenTraining(open_request(cap, 0, 2)),
        "forward": lambda cap: pair.sa.ForwardTrain(forward(cap, x)),
        "backward": lambda cap: pair.sa.BackwardTrain(backward(cap, None)),
        "norm": lambda cap: pair.sa.GradNorm(
            training_pb2.GradNormRequest(capability=cap, job_id=JOB)
        ),
        "step": lambda cap: pair.sa.OptimizerStep(
            training_pb2.OptimizerStepRequest(capability=cap, job_id=JOB, clip_coef=1.0)
        ),
        "save": lambda cap: pair.sa.SaveCheckpoint(
            training_pb2.SaveCheckpointRequest(capability=cap, job_id=JOB)
        ),
        "close": lambda cap: pair.sa.CloseTraining(
            training_pb2.CloseTrainingRequest(capability=cap, job_id=JOB)
        ),
    }
    for call in calls.values():
        await refused(call(None), grpc.StatusCode.UNAUTHENTICATED, "capability")
        await refused(call(forged), grpc.StatusCode.UNAUTHENTICATED, "does not verify")
        await refused(call(expired), grpc.StatusCode.UNAUTHENTICATED, "expired")
        await refused(call(other_job), grpc.StatusCode.PERMISSION_DENIED, "job-2")
        await refused(call(not_me), grpc.StatusCode.PERMISSION_DENIED, "not among")
        await refused(call(narrow), grpc.StatusCode.PERMISSION_DENIED, "outside")
        await refused(call(other_model), grpc.StatusCode.PERMISSION_DENIED, "model")
    # Nothing was changed by any of that: a whole step still runs.
    await full_step(pair, 0)


async def test_hostile_job_id_is_refused(pair: Pair, keys: CoordinatorKeys) -> None:
    hostile = "../../etc/passwd"
    cap = training_capability(keys, hostile, [(pair.a, 0, 2)])
    await refused(
        pair.sa.OpenTraining(open_request(cap, 0, 2, job_id=hostile)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "not a job id",
    )


# ---- OpenTraining --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"mode": "adam"}, "mode"),
        ({"mode": "lora", "lora_rank": 0}, "lora_rank"),
        ({"mode": "lora", "lora_rank": 100000}, "lora_rank"),
        ({"mode": "lora", "lora_alpha": float("nan")}, "lora_alpha"),
        ({"lr": float("nan")}, "lr"),
        ({"lr": -1.0}, "lr"),
        ({"beta1": 1.0}, "beta1"),
        ({"eps": 0.0}, "eps"),
        ({"weight_decay": float("inf")}, "weight_decay"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"micro_batches": 0}, "micro_batches"),
        ({"micro_batches": 100000}, "micro_batches"),
    ],
)
async def test_open_refuses_bad_hyper_parameters(
    pair: Pair, overrides: dict[str, Any], words: str
) -> None:
    h = hyper(overrides.pop("mode", "full"), **overrides)
    await refused(
        pair.sa.OpenTraining(open_request(pair.cap, 0, 2, hyper=h)),
        grpc.StatusCode.INVALID_ARGUMENT,
        words,
    )
    # The refused re-open did not touch the open job.
    await full_step(pair, 0)


async def test_open_refusals(pair: Pair, keys: CoordinatorKeys) -> None:
    wide = training_capability(keys, JOB, [(pair.a, 0, 4)])
    await refused(
        pair.sa.OpenTraining(open_request(wide, 0, 3)), grpc.StatusCode.NOT_FOUND, "READY shard"
    )
    await refused(
        pair.sa.OpenTraining(open_request(wide, 2, 2)), grpc.StatusCode.INVALID_ARGUMENT, "empty"
    )
    await refused(
        pair.sa.OpenTraining(open_request(pair.cap, 0, 2, restore_step=3)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "restore_sha256",
    )
    await refused(
        pair.sa.OpenTraining(open_request(pair.cap, 0, 2, restore_sha256="0" * 64)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "restore_step",
    )
    await refused(
        pair.sa.OpenTraining(open_request(pair.cap, 0, 2, restore_step=3, restore_sha256="a" * 64)),
        grpc.StatusCode.NOT_FOUND,
        "no checkpoint",
    )


async def test_open_refuses_a_state_that_does_not_fit_usable_memory(
    start_node, keys: CoordinatorKeys, checkpoint
) -> None:
    config = load_model_config(checkpoint)
    full = training_memory(config, 0, 4, "full", 4, 4)
    lora = training_memory(config, 0, 4, "lora", 4, 4)
    weights = full.weight_bytes  # the served shard is fp32 too
    lora_fixed = lora.weight_bytes + lora.grad_bytes + lora.optimizer_bytes
    full_fixed = full.weight_bytes + full.grad_bytes + full.optimizer_bytes
    assert lora_fixed < full_fixed
    node = await start_node([(0, 4)], usable_bytes=weights + (lora_fixed + full_fixed) // 2)
    cap = training_capability(keys, JOB, [(node, 0, 4)])
    s, channel = stub(node)
    try:
        details = await refused(
            s.OpenTraining(open_request(cap, 0, 4)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "usable memory",
            "mode='lora'",
        )
        assert "MiB" in details
        opened = await s.OpenTraining(open_request(cap, 0, 4, hyper=hyper("lora")))
        assert opened.state_bytes == lora_fixed
        assert opened.trainable_params == lora.trainable_params
    finally:
        await channel.close()


async def test_activations_beyond_memory_are_recomputed_or_refused(
    start_node, keys: CoordinatorKeys, checkpoint
) -> None:
    """Keep activations when every micro-batch of the step fits; otherwise keep inputs and
    recompute (same loss, same gradients); refuse when even that does not fit."""
    config = load_model_config(checkpoint)
    memory = training_memory(config, 0, 4, "lora", 4, 4)
    shard = training_memory(config, 0, 4, "full", 4, 4).weight_bytes
    fixed = memory.weight_bytes + memory.grad_bytes + memory.optimizer_bytes
    tokens, labels = counting_batch(0, batch=4)
    per_mb = tokens.size // 2
    keep = per_mb * memory.activation_bytes_per_token
    inputs = per_mb * memory.input_bytes_per_token
    assert 2 * inputs + keep < 2 * keep
    roomy = await start_node([(0, 4)])
    tight = await start_node([(0, 4)], usable_bytes=shard + fixed + 2 * inputs + keep + 64)
    too_tight = await start_node([(0, 4)], usable_bytes=shard + fixed + keep // 2)
    h = hyper("lora", micro_batches=2)
    results = []
    for node in (roomy, tight, too_tight):
        cap = training_capability(keys, JOB, [(node, 0, 4)])
        s, channel = stub(node)
        try:
            await s.OpenTraining(open_request(cap, 0, 4, hyper=h))
            if node is too_tight:
                await refused(
                    s.ForwardTrain(
                        forward(cap, codec.encode(tokens[:2], "int64"), labels=labels[:2])
                    ),
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "smaller micro-batches",
                )
                continue
            losses = []
            for mb in range(2):
                x = codec.encode(tokens[2 * mb : 2 * mb + 2], "int64")
                reply = await s.ForwardTrain(
                    forward(cap, x, mb=mb, labels=labels[2 * mb : 2 * mb + 2])
                )
                losses.append(reply.loss)
            recomputed = sorted(node.training._jobs[JOB].recompute_reserve)
            for mb in range(2):
                await s.BackwardTrain(backward(cap, None, mb=mb))
            norm = await s.GradNorm(training_pb2.GradNormRequest(capability=cap, job_id=JOB))
            results.append((losses, recomputed, norm.sq_norm))
        finally:
            await channel.close()
    (roomy_losses, roomy_recomputed, roomy_norm), (tight_losses, tight_recomputed, tight_norm) = (
        results
    )
    assert roomy_recomputed == [] and tight_recomputed == [0, 1]
    assert tight_losses == pytest.approx(roomy_losses, rel=1e-6)
    assert tight_norm == pytest.approx(roomy_norm, rel=1e-5)


# ---- ForwardTrain --------------------------------------------------------------------------


async def test_forward_refusals(pair: Pair) -> None:
    tokens, labels = tokens_mb(0)
    ids = codec.encode(tokens, "int64")
    hidden = codec.encode(np.zeros((2, 12, HIDDEN), np.float32), "float32")
    cases = [
        (
            pair.sa.ForwardTrain(forward(pair.cap, ids, job="job-9")),
            grpc.StatusCode.PERMISSION_DENIED,
            "job-9",
        ),
        (
            pair.sa.ForwardTrain(forward(pair.cap, ids, step=1)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "stale step 1",
        ),
        (
            pair.sa.ForwardTrain(forward(pair.cap, ids, mb=2)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "out of range",
        ),
        (
            pair.sa.ForwardTrain(forward(pair.cap, None)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "no input",
        ),
        (
            pair.sa.ForwardTrain(forward(pair.cap, hidden)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "dtype",
        ),
        (
            pair.sa.ForwardTrain(forward(pair.cap, codec.encode(tokens + VOCAB, "int64"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "vocabulary",
        ),
        (
            pair.sa.ForwardTrain(
                forward(pair.cap, common_pb2.Tensor(dtype="int64", shape=[2, 12], data=b"xx"))
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "bytes",
        ),
        (
            pair.sa.ForwardTrain(forward(pair.cap, ids, labels=labels)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "only the last stage",
        ),
        (
            pair.sb.ForwardTrain(forward(pair.cap, ids, labels=labels)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "hidden states",
        ),
        (
            pair.sb.ForwardTrain(
                forward(pair.cap, codec.encode(np.zeros((2, 12, 8), np.float32)), labels=labels)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"must be {HIDDEN}",
        ),
        (
            pair.sb.ForwardTrain(
                forward(
                    pair.cap, codec.encode(np.zeros((2, 12, HIDDEN), np.float16)), labels=labels
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "float32",
        ),
        (
            pair.sb.ForwardTrain(
                forward(
                    pair.cap,
                    codec.encode(np.full((2, 12, HIDDEN), np.nan, np.float32)),
                    labels=labels,
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "NaN",
        ),
        (
            pair.sb.ForwardTrain(forward(pair.cap, hidden)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "send the labels",
        ),
        (
            pair.sb.ForwardTrain(forward(pair.cap, hidden, labels=labels[:, :5])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "labels",
        ),
        (
            pair.sb.ForwardTrain(forward(pair.cap, hidden, labels=np.full_like(labels, -100))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "undefined",
        ),
        (
            pair.sb.ForwardTrain(forward(pair.cap, hidden, labels=labels + 1000)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "labels must be token ids",
        ),
    ]
    for call, code, words in cases:
        await refused(call, code, words)
    assert pair.a.training._jobs[JOB].held == {} and pair.b.training._jobs[JOB].held == {}
    # A micro-batch runs forward once per step.
    await pair.sa.ForwardTrain(forward(pair.cap, ids))
    await refused(
        pair.sa.ForwardTrain(forward(pair.cap, ids)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "awaits backward",
    )


async def test_forward_refuses_oversized_input(start_node, keys: CoordinatorKeys) -> None:
    node = await start_node(
        [(0, 4)], limits=TrainingLimits(max_batch=4, max_tokens_per_micro_batch=64)
    )
    cap = training_capability(keys, JOB, [(node, 0, 4)], max_tokens=48)
    s, channel = stub(node)
    try:
        await s.OpenTraining(open_request(cap, 0, 4, hyper=hyper(micro_batches=1)))
        for batch, seq, words in [
            (2, 40, "exceed the limit"),
            (5, 4, "larger than"),
            (1, 49, "positions"),
        ]:
            tokens, labels = counting_batch(0, batch=batch, seq=seq)
            await refused(
                s.ForwardTrain(forward(cap, codec.encode(tokens, "int64"), labels=labels)),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                words,
            )
        tokens, labels = counting_batch(0, batch=4, seq=16)
        assert (
            await s.ForwardTrain(forward(cap, codec.encode(tokens, "int64"), labels=labels))
        ).loss > 0
    finally:
        await channel.close()


# ---- BackwardTrain -------------------------------------------------------------------------


async def test_backward_refusals(pair: Pair) -> None:
    await refused(
        pair.sb.BackwardTrain(backward(pair.cap, None, mb=1)),
        grpc.StatusCode.NOT_FOUND,
        "unknown micro-batch 1",
    )
    tokens, labels = tokens_mb(0)
    out = await pair.sa.ForwardTrain(forward(pair.cap, codec.encode(tokens, "int64")))
    await pair.sb.ForwardTrain(forward(pair.cap, out.output, labels=labels))
    await refused(
        pair.sb.BackwardTrain(backward(pair.cap, np.zeros((2, 12, HIDDEN)))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "send no grad_output",
    )
    back = await pair.sb.BackwardTrain(backward(pair.cap, None))
    await refused(
        pair.sb.BackwardTrain(backward(pair.cap, None)),
        grpc.StatusCode.NOT_FOUND,
        "already backpropagated",
    )
    grad = codec.decode(back.grad_input)
    for bad, code, words in [
        (None, grpc.StatusCode.INVALID_ARGUMENT, "needs grad_output"),
        (grad[:, :5], grpc.StatusCode.INVALID_ARGUMENT, "grad_output is"),
        (np.zeros((2, 12, 8)), grpc.StatusCode.INVALID_ARGUMENT, f"must be {HIDDEN}"),
        (codec.encode(grad.astype(np.float16)), grpc.StatusCode.INVALID_ARGUMENT, "float32"),
        (
            codec.encode(grad.astype(np.float64).astype(np.float32)[..., 0]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "dimensions",
        ),
    ]:
        await refused(pair.sa.BackwardTrain(backward(pair.cap, bad)), code, words)
    assert pair.a.training._jobs[JOB].held.keys() == {0}


async def test_nan_gradients_are_refused_reported_and_never_applied(pair: Pair) -> None:
    before = params_of(pair.a)
    tokens, labels = tokens_mb(0)
    out = await pair.sa.ForwardTrain(forward(pair.cap, codec.encode(tokens, "int64")))
    await pair.sb.ForwardTrain(forward(pair.cap, out.output, labels=labels))
    back = await pair.sb.BackwardTrain(backward(pair.cap, None))
    grad = codec.decode(back.grad_input).copy()
    poisoned = grad.copy()
    poisoned[0, 3, 5] = np.nan
    for bad in (poisoned, np.full_like(grad, np.inf)):
        await refused(
            pair.sa.BackwardTrain(backward(pair.cap, bad)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "NaN or inf",
            "not applied",
        )
    job = pair.a.training._jobs[JOB]
    assert job.nonfinite_refusals == 2
    assert job.trainer.grad_sq_norm() == 0.0  # nothing accumulated
    # The micro-batch is still pending: a finite retry goes through.
    await pair.sa.BackwardTrain(backward(pair.cap, grad))
    assert job.trainer.grad_sq_norm() > 0
    await run_micro_batch(pair, 1)
    for s in (pair.sa, pair.sb):
        await s.GradNorm(training_pb2.GradNormRequest(capability=pair.cap, job_id=JOB))
        await s.OptimizerStep(
            training_pb2.OptimizerStepRequest(capability=pair.cap, job_id=JOB, clip_coef=1.0)
        )
    after = params_of(pair.a)
    assert all(torch.isfinite(t).all() for t in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)


async def test_gradients_that_overflow_on_the_stage_abandon_the_step(pair: Pair) -> None:
    """A finite but huge gradient overflows inside the stage's backward: refused, the step
    reported non-finite by GradNorm and abandoned, nothing applied, the step retryable."""
    before = params_of(pair.a)
    tokens, _ = tokens_mb(0)
    await pair.sa.ForwardTrain(forward(pair.cap, codec.encode(tokens, "int64")))
    huge = np.full((2, 12, HIDDEN), 3e38, np.float32)
    await refused(
        pair.sa.BackwardTrain(backward(pair.cap, huge)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "poisoned",
        "GradNorm",
    )
    step_request = training_pb2.OptimizerStepRequest(capability=pair.cap, job_id=JOB, clip_coef=1.0)
    await refused(pair.sa.OptimizerStep(step_request), grpc.StatusCode.FAILED_PRECONDITION)
    norm = await pair.sa.GradNorm(training_pb2.GradNormRequest(capability=pair.cap, job_id=JOB))
    assert not norm.finite
    await refused(
        pair.sa.OptimizerStep(step_request), grpc.StatusCode.FAILED_PRECONDITION, "abandoned"
    )
    after = params_of(pair.a)
    assert all(torch.equal(before[n], after[n]) for n in before)
    # B never saw the step; A forgot it: the same step runs again at version 0.
    await full_step(pair, 0)


# ---- GradNorm / OptimizerStep --------------------------------------------------------------


async def test_grad_norm_and_optimizer_step_refusals(pair: Pair) -> None:
    def norm(step: int = 0) -> training_pb2.GradNormRequest:
        return training_pb2.GradNormRequest(capability=pair.cap, job_id=JOB, step=step)

    def opt(step: int = 0, clip: float = 1.0) -> training_pb2.OptimizerStepRequest:
        return training_pb2.OptimizerStepRequest(
            capability=pair.cap, job_id=JOB, step=step, clip_coef=clip
        )

    await refused(
        pair.sa.OptimizerStep(opt()), grpc.StatusCode.FAILED_PRECONDITION, "not backpropagated"
    )
    tokens, labels = tokens_mb(0)
    out = await pair.sa.ForwardTrain(forward(pair.cap, codec.encode(tokens, "int64")))
    await refused(pair.sa.GradNorm(norm()), grpc.StatusCode.FAILED_PRECONDITION, "await backward")
    await pair.sb.ForwardTrain(forward(pair.cap, out.output, labels=labels))
    back = await pair.sb.BackwardTrain(backward(pair.cap, None))
    await pair.sa.BackwardTrain(backward(pair.cap, back.grad_input))
    await refused(pair.sa.GradNorm(norm()), grpc.StatusCode.FAILED_PRECONDITION, "[1]")
    await run_micro_batch(pair, 1)
    for clip in (0.0, -1.0, 1.5, math.nan, math.inf):
        await refused(
            pair.sa.OptimizerStep(opt(clip=clip)), grpc.StatusCode.INVALID_ARGUMENT, "clip_coef"
        )
    for s in (pair.sa, pair.sb):
        assert (await s.GradNorm(norm())).finite
        assert (await s.OptimizerStep(opt(clip=0.5))).step == 1
    # Repeated and stale steps are refused; the version stays 1.
    for stale in (0, 5):
        await refused(
            pair.sa.OptimizerStep(opt(stale)), grpc.StatusCode.FAILED_PRECONDITION, "stale step"
        )
        await refused(
            pair.sa.GradNorm(norm(stale)), grpc.StatusCode.FAILED_PRECONDITION, "stale step"
        )
    assert pair.a.training._jobs[JOB].trainer.version == 1
    await full_step(pair, 1)


# ---- SaveCheckpoint / restore / CloseTraining ----------------------------------------------


async def test_checkpoint_restore_and_close(pair: Pair, store, keys: CoordinatorKeys) -> None:
    def save(s: Any, step: int) -> Any:
        return s.SaveCheckpoint(
            training_pb2.SaveCheckpointRequest(capability=pair.cap, job_id=JOB, step=step)
        )

    await full_step(pair, 0)
    await refused(save(pair.sa, 0), grpc.StatusCode.FAILED_PRECONDITION, "stale step")
    saved_a = await save(pair.sa, 1)
    assert not saved_a.consistent
    saved_b = await save(pair.sb, 1)
    assert saved_b.consistent and store.consistent(JOB, 1)
    assert saved_a.sha256 == store.stored[(JOB, 1, 0, 2)].sha256
    later = await full_step(pair, 1)
    # Mid-step checkpoints are refused.
    await run_micro_batch(pair, 0, step=2)
    await refused(save(pair.sa, 2), grpc.StatusCode.FAILED_PRECONDITION, "checkpoint between steps")
    # Restore: wrong sha256 refused, right one rolls back to step 1 and repeats step 1 exactly.
    await refused(
        pair.sa.OpenTraining(
            open_request(pair.cap, 0, 2, restore_step=1, restore_sha256=saved_b.sha256)
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "asked for",
    )
    await refused(  # another stage's sha256
        pair.sb.OpenTraining(
            open_request(pair.cap, 2, 4, restore_step=1, restore_sha256=saved_a.sha256)
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert (
        await pair.sa.OpenTraining(
            open_request(pair.cap, 0, 2, restore_step=1, restore_sha256=saved_a.sha256)
        )
    ).step == 1
    assert (
        await pair.sb.OpenTraining(
            open_request(pair.cap, 2, 4, restore_step=1, restore_sha256=saved_b.sha256)
        )
    ).step == 1
    assert await full_step(pair, 1) == pytest.approx(later, rel=1e-6)
    # A corrupted stored copy is detected on download.
    stored = store.stored[(JOB, 1, 0, 2)]
    stored.data = stored.data[:-1] + bytes([stored.data[-1] ^ 1])
    await refused(
        pair.sa.OpenTraining(
            open_request(pair.cap, 0, 2, restore_step=1, restore_sha256=saved_a.sha256)
        ),
        grpc.StatusCode.DATA_LOSS,
        "corrupt",
    )
    # Close: the job is gone; closing twice says so.
    close = training_pb2.CloseTrainingRequest(capability=pair.cap, job_id=JOB)
    await pair.sb.CloseTraining(close)
    await refused(pair.sb.CloseTraining(close), grpc.StatusCode.NOT_FOUND, "OpenTraining")
    await refused(save(pair.sb, 2), grpc.StatusCode.NOT_FOUND)


async def test_save_with_the_store_unreachable_is_unavailable(
    pair: Pair, store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The node tries an unreachable store again for a minute (a coordinator restart);
    # the retries themselves are tested in tests/node_agent/test_checkpoint_patience.py.
    monkeypatch.setattr(checkpoint_client, "UPSTREAM_PATIENCE_S", 1.0)
    await full_step(pair, 0)
    await store.stop()
    await refused(
        pair.sa.SaveCheckpoint(
            training_pb2.SaveCheckpointRequest(capability=pair.cap, job_id=JOB, step=1)
        ),
        grpc.StatusCode.UNAVAILABLE,
        "unreachable",
    )
    await full_step(pair, 1)  # the job is fine


async def test_node_without_ticket_is_refused_by_the_store(
    pair: Pair, store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A refused ticket waits 15 s for the agent to register again (a restarted
    # coordinator); this node never does.
    monkeypatch.setattr(checkpoint_client, "NEW_TICKET_WAIT_S", 0.5)
    await full_step(pair, 0)
    pair.a.ctx.attach_ticket = b"stale"
    await refused(
        pair.sa.SaveCheckpoint(
            training_pb2.SaveCheckpointRequest(capability=pair.cap, job_id=JOB, step=1)
        ),
        grpc.StatusCode.UNAUTHENTICATED,
        "refused the upload",
    )


async def test_idle_jobs_are_dropped(start_node, keys: CoordinatorKeys) -> None:
    node = await start_node([(0, 4)], limits=TrainingLimits(idle_ttl_s=0.3, expiry_interval_s=0.1))
    cap = training_capability(keys, JOB, [(node, 0, 4)])
    s, channel = stub(node)
    try:
        await s.OpenTraining(open_request(cap, 0, 4))
        tokens, labels = counting_batch(0, batch=2)
        await s.ForwardTrain(forward(cap, codec.encode(tokens, "int64"), labels=labels))
        assert JOB in node.training._jobs
        for _ in range(50):
            if JOB not in node.training._jobs:
                break
            await asyncio.sleep(0.1)
        await refused(
            s.BackwardTrain(backward(cap, None)), grpc.StatusCode.NOT_FOUND, "OpenTraining"
        )
    finally:
        await channel.close()
