"""Training disputes and agreements at the coordinator: strict checks, no framing.

A real in-process coordinator with a job whose stages and checkers are fake nodes of
different operators (tests/jobs/jobs_harness.py). The test signs replies with those
nodes' own keys, as their training servers would, so it can build sound and hostile
reports. Every hostile report is refused with the right status and bans no one; a sound
dispute that no arbiter can replay (these nodes have no data plane) is UNRESOLVED, bans
no one, and both nodes lose their streak; sound agreements earn both nodes trust.
"""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
from jobs.jobs_harness import JobsCoordinator, start_jobs, tiny_model  # noqa: F401 - fixtures

from coordinator.node_state import NodeState
from coordinator.verifier.training_evidence import MAX_AGREEMENTS, MAX_DISPUTE_CALLS
from protos import codec, identity, output_check
from protos.tessera.v1 import jobs_pb2, verification_pb2, verification_pb2_grpc

KIND = verification_pb2.TrainingCall.Kind
Outcome = verification_pb2.Verdict.Outcome
ROGUE = identity.generate_private_key()
INPUT = codec.encode(np.ones((1, 4, 8), dtype=np.float32), "float32")


@pytest.fixture
async def job(start_jobs):  # noqa: F811 - the fixture
    # Trust after one verified result, so that falling probabilities show in a few reports.
    # One stage holding the whole model: every other node can check it.
    jc = await start_jobs(
        nodes=4, accounts=[f"op{i}" for i in range(4)], verify_warmup=1, min_stages=1, replicas=4
    )
    await jc.ready(replicas=4)
    await jc.all_ready()
    dataset = await jc.upload(np.arange(400, dtype=np.int32) % 60)
    info = await jc.submit(dataset.id)
    session = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=info.job_id)
    )
    assert session.checkers, "the job needs a checker of another operator"
    return jc, session


def stub(jc: JobsCoordinator) -> verification_pb2_grpc.VerificationStub:
    return verification_pb2_grpc.VerificationStub(jc.channel)


def sign(key, job_id: str, call: verification_pb2.TrainingCall, layers, data: bytes, sent: bytes):
    output_sha256 = hashlib.sha256(data).digest()
    mb = call.micro_batch if call.kind in (KIND.FORWARD, KIND.BACKWARD) else 0
    name = {KIND.FORWARD: "forward", KIND.BACKWARD: "backward", KIND.NORM: "norm",
            KIND.OPTIMIZER_STEP: "step"}[call.kind]  # fmt: skip
    payload = identity.training_payload(
        name, job_id, call.step, mb, layers.start, layers.end, output_sha256, sent
    )
    return verification_pb2.SignedTrainingReply(
        node_id=identity.node_id(identity.public_key_bytes(key)) if key is not ROGUE else "",
        input_digest=sent, output_sha256=output_sha256, signature=key.sign(payload),
    )  # fmt: skip


def dispute(
    jc: JobsCoordinator, session, *, checker_key=None, primary_key=None, answers=(1.0, 2.0),
    logged_input=INPUT, step=0,
) -> verification_pb2.TrainingDispute:  # fmt: skip
    """A sound forward dispute of the first checked stage (a call of ``step``)."""
    checker = session.checkers[0]
    primary = next(h for h in session.hops if h.layers == checker.layers)
    keys = {
        "primary": primary_key or jc.node(primary.node_id).key,
        "checker": checker_key or jc.node(checker.node_id).key,
    }
    call = verification_pb2.TrainingCall(kind=KIND.FORWARD, step=step, micro_batch=0)
    call.input.CopyFrom(logged_input)
    sent = output_check.tensor_digest(INPUT, None)  # an input, no labels (not the last stage)
    answer = {
        role: verification_pb2.TrainingAnswer(
            output=codec.encode(np.full((1, 4, 8), value, dtype=np.float32), "float32")
        )
        for role, value in zip(("primary", "checker"), answers, strict=True)
    }
    for role in ("primary", "checker"):
        signed = sign(keys[role], session.job_id, call, checker.layers,
                      answer[role].output.data, sent)  # fmt: skip
        signed.node_id = primary.node_id if role == "primary" else checker.node_id
        getattr(call, role).CopyFrom(signed)
    return verification_pb2.TrainingDispute(
        job_id=session.job_id, capability=session.capability, layers=checker.layers,
        primary_node_id=primary.node_id, checker_node_id=checker.node_id,
        calls=[call], primary_answer=answer["primary"], checker_answer=answer["checker"],
    )  # fmt: skip


def claims_of(jc: JobsCoordinator, session):
    claims = identity.open_capability(jc.coordinator.ctx.public_key, session.capability)
    assert claims is not None
    return claims


def banned(jc: JobsCoordinator) -> list[str]:
    registry = jc.coordinator.ctx.registry
    return [n.node_id for n in jc.nodes if registry.node(n.node_id).state is NodeState.BANNED]


async def refused(call, request, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(request)
    assert info.value.code() == code, info.value.details()
    assert words in info.value.details(), info.value.details()


async def test_a_sound_dispute_nobody_can_replay_is_unresolved_and_bans_no_one(job) -> None:
    jc, session = job
    request = dispute(jc, session)
    verdict = await stub(jc).ReportTrainingDispute(request)
    assert verdict.outcome == Outcome.UNRESOLVED and "no independent arbiter" in verdict.detail
    assert banned(jc) == []
    trust = jc.coordinator.ctx.verifier.reputation
    for node_id in (request.primary_node_id, request.checker_node_id):
        assert trust.record(node_id).failures == 1  # both lose their streak
    # The same signed replies are never judged twice.
    await refused(stub(jc).ReportTrainingDispute, request, grpc.StatusCode.ALREADY_EXISTS,
                  "already reported")  # fmt: skip


async def test_hostile_disputes_are_refused_and_ban_no_one(job) -> None:
    jc, session = job
    report = stub(jc).ReportTrainingDispute
    forged = dispute(jc, session, primary_key=ROGUE)
    await refused(report, forged, grpc.StatusCode.PERMISSION_DENIED, "does not verify")
    unsigned = dispute(jc, session)
    unsigned.calls[0].primary.signature = b""
    await refused(report, unsigned, grpc.StatusCode.PERMISSION_DENIED, "does not verify")
    # A client logs another input than the nodes computed on (to frame one of them).
    other = codec.encode(np.zeros((1, 4, 8), dtype=np.float32), "float32")
    framed = dispute(jc, session, logged_input=other)
    await refused(report, framed, grpc.StatusCode.INVALID_ARGUMENT, "not what node")
    agreeing = dispute(jc, session, answers=(1.0, 1.0 + 1e-7))
    await refused(report, agreeing, grpc.StatusCode.INVALID_ARGUMENT, "agree")
    swapped = dispute(jc, session)
    swapped.primary_answer.output.CopyFrom(swapped.checker_answer.output)
    await refused(report, swapped, grpc.StatusCode.INVALID_ARGUMENT, "not the one it signed")
    clipped = dispute(jc, session)
    step = clipped.calls.add(kind=KIND.OPTIMIZER_STEP, step=0, clip_coef=0.5)
    for role, node_id in (("primary", clipped.primary_node_id),
                          ("checker", clipped.checker_node_id)):  # fmt: skip
        applied = identity.training_step_bytes(1.0, 1)  # signed 1.0, logged 0.5
        signed = sign(jc.node(node_id).key, session.job_id, step, clipped.layers, applied, b"")
        signed.node_id = node_id
        getattr(step, role).CopyFrom(signed)
    clipped.calls.append(clipped.calls[0])  # the last call must be the disputed one
    await refused(report, clipped, grpc.StatusCode.INVALID_ARGUMENT, "clip coefficient")
    oversized = dispute(jc, session)
    oversized.calls.extend([oversized.calls[0]] * MAX_DISPUTE_CALLS)
    await refused(report, oversized, grpc.StatusCode.RESOURCE_EXHAUSTED, "calls")
    unknown = dispute(jc, session)
    unknown.job_id = "j0000000000000000"
    await refused(report, unknown, grpc.StatusCode.NOT_FOUND, "no job")
    same = dispute(jc, session)
    same.checker_node_id = same.primary_node_id
    await refused(report, same, grpc.StatusCode.INVALID_ARGUMENT, "two different nodes")
    stranger = dispute(jc, session)
    stranger.checker_node_id = identity.node_id(identity.public_key_bytes(ROGUE))
    await refused(report, stranger, grpc.StatusCode.PERMISSION_DENIED, "grants node")
    no_checkpoint = dispute(jc, session, step=2)
    no_checkpoint.restore_step, no_checkpoint.restore_sha256 = 2, "ab" * 32
    await refused(report, no_checkpoint, grpc.StatusCode.FAILED_PRECONDITION, "no checkpoint")
    forged_capability = dispute(jc, session)
    forged_capability.capability.signature = ROGUE.sign(forged_capability.capability.claims)
    await refused(report, forged_capability, grpc.StatusCode.UNAUTHENTICATED, "not signed")
    assert banned(jc) == []
    trust = jc.coordinator.ctx.verifier.reputation
    assert all(trust.record(n.node_id).failures == 0 for n in jc.nodes)
    # Still serving: the sound dispute is judged.
    verdict = await report(dispute(jc, session))
    assert verdict.outcome == Outcome.UNRESOLVED and banned(jc) == []


def agreement(jc: JobsCoordinator, session, step: int) -> verification_pb2.TrainingAgreement:
    sound = dispute(jc, session, answers=(1.0, 1.0))
    call = sound.calls[0]
    call.step = step
    for role, node_id in (("primary", sound.primary_node_id), ("checker", sound.checker_node_id)):
        signed = sign(jc.node(node_id).key, session.job_id, call, sound.layers,
                      sound.primary_answer.output.data, call.primary.input_digest)  # fmt: skip
        signed.node_id = node_id
        getattr(call, role).CopyFrom(signed)
    return verification_pb2.TrainingAgreement(
        kind=call.kind, step=step, micro_batch=0, layers=sound.layers,
        primary=call.primary, checker=call.checker,
    )  # fmt: skip


async def test_agreements_earn_both_nodes_trust_once_and_a_dispute_resets_it(job) -> None:
    jc, session = job
    report = stub(jc).ReportTrainingChecks
    checks = verification_pb2.TrainingChecks(
        job_id=session.job_id, capability=session.capability,
        agreements=[agreement(jc, session, step) for step in range(3)],
    )  # fmt: skip
    assert (await report(checks)).accepted == 3
    trust = jc.coordinator.ctx.verifier.reputation
    pair = (checks.agreements[0].primary.node_id, checks.agreements[0].checker.node_id)
    assert [trust.record(n).consecutive for n in pair] == [3, 3]
    # The check probability falls with trust, and the next session grants it.
    assert trust.probability(pair[0]) == pytest.approx(1 / 3)
    reopened = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=session.job_id)
    )
    grants = {g.node_id: g for g in claims_of(jc, reopened).grants}
    assert grants[pair[0]].check_probability == pytest.approx(1 / 3)
    await refused(report, checks, grpc.StatusCode.ALREADY_EXISTS, "already reported")
    forged = verification_pb2.TrainingChecks(
        job_id=session.job_id, capability=session.capability,
        agreements=[agreement(jc, session, 7)],
    )  # fmt: skip
    forged.agreements[0].checker.signature = ROGUE.sign(b"x")
    await refused(report, forged, grpc.StatusCode.PERMISSION_DENIED, "does not verify")
    flood = verification_pb2.TrainingChecks(
        job_id=session.job_id, capability=session.capability,
        agreements=[forged.agreements[0]] * (MAX_AGREEMENTS + 1),
    )  # fmt: skip
    await refused(report, flood, grpc.StatusCode.RESOURCE_EXHAUSTED, "agreements")
    assert [trust.record(n).consecutive for n in pair] == [3, 3]
    # A dispute nobody can settle costs both their streak: checked on every call again.
    verdict = await stub(jc).ReportTrainingDispute(dispute(jc, reopened, step=5))
    assert verdict.outcome == Outcome.UNRESOLVED
    assert [trust.probability(n) for n in pair] == [1.0, 1.0]


async def test_malformed_agreements_are_refused_and_earn_no_trust(job) -> None:
    jc, session = job
    report = stub(jc).ReportTrainingChecks

    def checks(*agreements: verification_pb2.TrainingAgreement) -> verification_pb2.TrainingChecks:
        return verification_pb2.TrainingChecks(
            job_id=session.job_id, capability=session.capability, agreements=list(agreements)
        )

    one_node = agreement(jc, session, 0)
    one_node.checker.CopyFrom(one_node.primary)
    step_kind = agreement(jc, session, 1)
    step_kind.kind = KIND.OPTIMIZER_STEP  # not a result two nodes compute alike
    unknown_kind = agreement(jc, session, 2)
    unknown_kind.kind = 99  # type: ignore[assignment]
    other_inputs = agreement(jc, session, 3)
    other_inputs.checker.input_digest = b"\x01" * 32
    outside = agreement(jc, session, 4)
    outside.layers.end += 2**31  # layers the job's capability never granted
    cases = [
        (one_node, grpc.StatusCode.INVALID_ARGUMENT, "two nodes of different operators"),
        (step_kind, grpc.StatusCode.INVALID_ARGUMENT, "forward, backward or norm"),
        (unknown_kind, grpc.StatusCode.INVALID_ARGUMENT, "forward, backward or norm"),
        (other_inputs, grpc.StatusCode.INVALID_ARGUMENT, "one input"),
        (outside, grpc.StatusCode.PERMISSION_DENIED, "no key for layers"),
    ]
    for bad, code, words in cases:
        # Alone, and after a sound agreement: one bad entry refuses the whole report.
        for request in (checks(bad), checks(agreement(jc, session, 9), bad)):
            await refused(report, request, code, words)
    trust = jc.coordinator.ctx.verifier.reputation
    assert all(trust.record(n.node_id).consecutive == 0 for n in jc.nodes)
    # Still serving: the sound agreement, refused only for its company above, counts once.
    assert (await report(checks(agreement(jc, session, 9)))).accepted == 1
