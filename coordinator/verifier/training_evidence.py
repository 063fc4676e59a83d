"""Checking a training dispute before anything is believed.

A driver's dispute names a stage (layers), its node (the primary) and the lockstep
checker, the checkpoint both started from, every call of the stage since then, and both
nodes' full answers to the last, disputed call. It is accepted only when:

- both nodes are granted exactly those layers by the job's own capability (whose keys and
  accounts the coordinator filled in), are two nodes, and belong to different operators;
- every logged call carries both nodes' valid signatures over that call, and every input
  in the log (forward inputs and labels, backward output gradients) hashes to the input
  digest *both* nodes signed, and every optimizer step's clip coefficient is the one both
  signed: a client cannot make an arbiter replay anything a node did not compute on, so
  it cannot frame an honest node;
- the disputed answers hash to what each node signed, and really differ beyond the fp32
  tolerance; the checkpoint is one the coordinator holds, with that sha256.

Whatever fails here is refused with a status and a message, and changes nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import grpc

from coordinator.operators import same_operator
from coordinator.verifier.evidence import DIGEST_BYTES, ReportError
from protos import identity, output_check, training_answers
from protos.tessera.v1 import client_api_pb2, verification_pb2

KIND = verification_pb2.TrainingCall.Kind
MAX_DISPUTE_CALLS = 4096
MAX_AGREEMENTS = 1024


@dataclass(frozen=True)
class TrainingCase:
    """A validated dispute: the two nodes' grants and how far their answers are apart."""

    dispute: verification_pb2.TrainingDispute
    primary: client_api_pb2.Hop
    checker: client_api_pb2.Hop
    disputed: verification_pb2.TrainingCall
    error: float


def dispute_id(dispute: verification_pb2.TrainingDispute) -> str:
    call = dispute.calls[-1]
    return hashlib.sha256(call.primary.signature + call.checker.signature).hexdigest()


def check_dispute(
    claims: client_api_pb2.CapabilityClaims,
    dispute: verification_pb2.TrainingDispute,
    micro_batches: int,
) -> TrainingCase:
    start, end = dispute.layers.start, dispute.layers.end
    primary = granted(claims, dispute.primary_node_id, start, end)
    checker = granted(claims, dispute.checker_node_id, start, end)
    if primary.node_id == checker.node_id:
        raise ReportError(grpc.StatusCode.INVALID_ARGUMENT, "a dispute needs two different nodes")
    if same_operator(primary.account, checker.account):
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"nodes {primary.node_id} and {checker.node_id} belong to one operator; their "
            "disagreement proves nothing about either",
        )
    calls = dispute.calls
    if not calls or len(calls) > MAX_DISPUTE_CALLS:
        raise ReportError(
            grpc.StatusCode.RESOURCE_EXHAUSTED if calls else grpc.StatusCode.INVALID_ARGUMENT,
            f"a dispute logs 1 to {MAX_DISPUTE_CALLS} calls since its checkpoint, not {len(calls)}",
        )
    if dispute.restore_step == 0 and dispute.restore_sha256:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT, "step 0 is the model's weights: give no sha256"
        )
    step = dispute.restore_step
    for index, call in enumerate(calls):
        if call.step < step:
            raise ReportError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"call {index} is of step {call.step}, before step {step}: log the calls in order",
            )
        step = call.step
        if call.micro_batch >= micro_batches:
            raise ReportError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"call {index} names micro-batch {call.micro_batch}; the job has {micro_batches}",
            )
        for grant, signed in ((primary, call.primary), (checker, call.checker)):
            _check_call(claims.session_id, index, call, grant, signed, start, end)
    disputed = calls[-1]
    if disputed.kind not in training_answers.DISPUTABLE:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "the disputed (last) call must be a forward, a backward or a gradient norm",
        )
    for signed, answer in (
        (disputed.primary, dispute.primary_answer),
        (disputed.checker, dispute.checker_answer),
    ):
        data = training_answers.answer_bytes(disputed.kind, answer)
        if hashlib.sha256(data).digest() != signed.output_sha256:
            raise ReportError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the answer given for node {signed.node_id} is not the one it signed",
            )
    error = training_answers.answer_error(
        disputed.kind, dispute.primary_answer, dispute.checker_answer
    )
    if error <= training_answers.tolerance():
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the two answers agree (relative error {error:.3g} within "
            f"{training_answers.tolerance():g}); there is nothing to arbitrate",
        )
    return TrainingCase(dispute, primary, checker, disputed, error)


def check_agreement(
    claims: client_api_pb2.CapabilityClaims, agreement: verification_pb2.TrainingAgreement
) -> tuple[str, str]:
    """Both nodes' ids once the agreement's signatures and pairing are proven sound."""
    start, end = agreement.layers.start, agreement.layers.end
    p, c = agreement.primary, agreement.checker
    primary = granted(claims, p.node_id, start, end)
    checker = granted(claims, c.node_id, start, end)
    if primary.node_id == checker.node_id or same_operator(primary.account, checker.account):
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "an agreement needs two nodes of different operators",
        )
    if agreement.kind not in training_answers.DISPUTABLE or p.input_digest != c.input_digest:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "an agreement is a forward, backward or norm both nodes signed on one input",
        )
    call = verification_pb2.TrainingCall(
        kind=agreement.kind, step=agreement.step, micro_batch=agreement.micro_batch
    )
    for index, (grant, signed) in enumerate(((primary, p), (checker, c))):
        _verify(claims.session_id, index, call, grant, signed, start, end, signed.input_digest)
    return primary.node_id, checker.node_id


def granted(
    claims: client_api_pb2.CapabilityClaims, node_id: str, start: int, end: int
) -> client_api_pb2.Hop:
    for grant in claims.grants:
        if grant.node_id == node_id and (grant.layers.start, grant.layers.end) == (start, end):
            if not grant.public_key:
                break
            return grant
    raise ReportError(
        grpc.StatusCode.PERMISSION_DENIED,
        f"the job's capability grants node {node_id[:64]!r} no key for layers [{start}, {end})",
    )


def _check_call(
    job_id: str,
    index: int,
    call: verification_pb2.TrainingCall,
    grant: client_api_pb2.Hop,
    signed: verification_pb2.SignedTrainingReply,
    start: int,
    end: int,
) -> None:
    if signed.node_id != grant.node_id:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"call {index} carries node {signed.node_id[:64]!r}'s reply where "
            f"{grant.node_id}'s belongs",
        )
    if call.kind == KIND.FORWARD:
        sent = output_check.tensor_digest(
            call.input, call.labels if call.HasField("labels") else None
        )
    elif call.kind == KIND.BACKWARD:
        sent = output_check.tensor_digest(call.input if call.HasField("input") else None)
    elif call.kind in (KIND.NORM, KIND.OPTIMIZER_STEP):
        sent = b""
    else:
        raise ReportError(grpc.StatusCode.INVALID_ARGUMENT, f"call {index} has no known kind")
    if signed.input_digest != sent:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the input logged for call {index} is not what node {grant.node_id} signed it "
            "computed on",
        )
    if call.kind == KIND.OPTIMIZER_STEP:
        applied = identity.training_step_bytes(call.clip_coef, call.step + 1)
        if hashlib.sha256(applied).digest() != signed.output_sha256:
            raise ReportError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"call {index}: node {grant.node_id} signed another clip coefficient",
            )
    _verify(job_id, index, call, grant, signed, start, end, sent)


def _verify(
    job_id: str,
    index: int,
    call: verification_pb2.TrainingCall,
    grant: client_api_pb2.Hop,
    signed: verification_pb2.SignedTrainingReply,
    start: int,
    end: int,
    sent: bytes,
) -> None:
    if len(signed.output_sha256) != DIGEST_BYTES:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT, f"call {index}: an output sha256 has 32 bytes"
        )
    micro_batch = call.micro_batch if call.kind in (KIND.FORWARD, KIND.BACKWARD) else 0
    payload = identity.training_payload(
        training_answers.PASS_NAMES[call.kind],
        job_id,
        call.step,
        micro_batch,
        start,
        end,
        signed.output_sha256,
        sent,
    )
    if not identity.verify(grant.public_key, signed.signature, payload):
        raise ReportError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"call {index}: the signature of node {grant.node_id} does not verify for this "
            "job, step and layers: the evidence is forged or corrupted",
        )
