"""Training answers as evidence: what a stage's signature hashes, and how far two answers
are apart. Shared by the driver (its lockstep comparisons) and the coordinator's verifier
(disputes), so both judge one answer by the same bytes and the same measure."""

from __future__ import annotations

import math

from protos import codec, identity, output_check
from protos.tessera.v1 import common_pb2, training_pb2, verification_pb2

KIND = verification_pb2.TrainingCall.Kind
DISPUTABLE = (KIND.FORWARD, KIND.BACKWARD, KIND.NORM)
# The pass each kind of call is signed as (protos.identity.training_payload).
PASS_NAMES = {
    KIND.FORWARD: "forward",
    KIND.BACKWARD: "backward",
    KIND.NORM: "norm",
    KIND.OPTIMIZER_STEP: "step",
}


def tolerance() -> float:
    """Training computes in fp32 on every node: one tolerance for every comparison. Its
    margin over honest fp32 differences (thousands of times) leaves depth no say."""
    return output_check.tolerance("cpu", "float32", layers=1)


def answer_bytes(kind: int, answer: verification_pb2.TrainingAnswer) -> bytes:
    """The bytes whose sha256 a node signs for this answer (see the node's _sign)."""
    if kind == KIND.FORWARD:
        if answer.HasField("output"):
            return answer.output.data
        return identity.training_loss_bytes(answer.loss, answer.label_tokens)
    if kind == KIND.BACKWARD:
        return answer.output.data
    if kind == KIND.NORM:
        return identity.training_norm_bytes(answer.sq_norm, answer.finite)
    raise ValueError(f"a {KIND.Name(kind)} answer is not compared")  # type: ignore[arg-type]


def tensor_error(a: common_pb2.Tensor, b: common_pb2.Tensor) -> float:
    """Relative L2 error of two wire tensors; inf when they cannot be compared."""
    if list(a.shape) != list(b.shape) or not a.dtype or not b.dtype:
        return float("inf")
    try:
        x, y = codec.decode(a, finite=False), codec.decode(b, finite=False)
    except ValueError:
        return float("inf")
    return output_check.relative_error(x, a.dtype, y, b.dtype)


def scalar_error(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b else float("inf")
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def answer_error(
    kind: int, a: verification_pb2.TrainingAnswer, b: verification_pb2.TrainingAnswer
) -> float:
    """How far apart two nodes' answers to one call are (relative)."""
    if kind == KIND.NORM:
        return scalar_error(a.sq_norm, b.sq_norm) if a.finite == b.finite else float("inf")
    if a.HasField("output") or b.HasField("output"):
        return tensor_error(a.output, b.output)
    if a.label_tokens != b.label_tokens:
        return float("inf")
    return scalar_error(a.loss, b.loss)


TrainingReply = (
    training_pb2.TrainForwardResponse
    | training_pb2.TrainBackwardResponse
    | training_pb2.GradNormResponse
    | training_pb2.OptimizerStepResponse
)


def answer_of(reply: TrainingReply) -> verification_pb2.TrainingAnswer:
    """A node's reply as a comparable answer: the shape drivers report and arbiters give."""
    answer = verification_pb2.TrainingAnswer()
    if isinstance(reply, training_pb2.TrainForwardResponse):
        if reply.HasField("output"):
            answer.output.CopyFrom(reply.output)
        answer.loss, answer.label_tokens = reply.loss, reply.label_tokens
    elif isinstance(reply, training_pb2.TrainBackwardResponse):
        if reply.HasField("grad_input"):  # none at the first stage
            answer.output.CopyFrom(reply.grad_input)
    elif isinstance(reply, training_pb2.GradNormResponse):
        answer.sq_norm, answer.finite = reply.sq_norm, reply.finite
    return answer
