"""Audit agreements in verification reports: what they earn, and what is refused.

A catch-up audit that found a primary's step right is reported as the primary's signed
answer for that step and the checker's signed answer to the catch-up call. Over real gRPC
against an in-process coordinator, as in test_report_bad_input.py: each primary step counts
once, a catch-up answer earns its checker trust once however many steps it vouched for (in
however many reports), and malformed, forged or same-operator audits are refused with the
right status while the coordinator keeps serving.
"""

from __future__ import annotations

import grpc
import numpy as np
from verification.test_report_bad_input import Node, Session, expect, setup  # noqa: F401

from coordinator.verifier.evidence import MAX_AUDITS
from protos import output_check
from protos.tessera.v1 import verification_pb2

CATCH_UP = np.array([[9, 10, 11, 12]], dtype=np.int64)


def step_output(session: Session, node: Node, step: int) -> verification_pb2.SignedOutput:
    signed = node.sign(session.session_id, step, np.full((1, 1, 8), float(step)))
    signed.ClearField("output")
    return signed


def catch_up_answer(session: Session, node: Node, step: int) -> verification_pb2.SignedOutput:
    """The checker's signed answer to a catch-up call at ``step``: its input digest chains
    past the steps it replayed."""
    digest = output_check.prefix_digest([(CATCH_UP, "int64")])
    signed = node.sign(session.session_id, step, np.ones((1, 4, 8)), digest=digest)
    signed.ClearField("output")
    return signed


def audits(
    session: Session, primary: Node, checker: Node, steps: range, at: int
) -> list[verification_pb2.AuditAgreement]:
    vouching = catch_up_answer(session, checker, at)
    return [
        verification_pb2.AuditAgreement(primary=step_output(session, primary, s), checker=vouching)
        for s in steps
    ]


async def test_audits_earn_the_primary_a_result_per_step_and_the_checker_one_per_answer(
    setup,  # noqa: F811
) -> None:
    harness, session, nodes, _ = setup
    x, y = nodes["x"], nodes["y"]
    reputation = harness.ctx.verifier.reputation
    first = audits(session, x, y, range(1, 6), at=6)
    await session.report(audits=first)
    assert reputation.record(x.node_id).consecutive == 5
    assert reputation.record(y.node_id).consecutive == 1
    # More steps vouched for by the same catch-up answer, in a later report: the primary
    # earns them, the checker's answer has already counted.
    vouching = first[0].checker
    later = [
        verification_pb2.AuditAgreement(primary=step_output(session, x, s), checker=vouching)
        for s in (6,)
    ]
    await session.report(audits=later)
    assert reputation.record(x.node_id).consecutive == 6
    assert reputation.record(y.node_id).consecutive == 1
    # The same primary step again: a replay, refused whole, nothing counted.
    await expect(
        grpc.StatusCode.ALREADY_EXISTS, lambda: session.report(audits=later), "already reported"
    )
    assert reputation.record(x.node_id).consecutive == 6


async def test_bad_audits_are_refused_and_count_nothing(setup) -> None:  # noqa: F811
    harness, session, nodes, _ = setup
    x, y, y2 = nodes["x"], nodes["y"], nodes["y2"]
    reputation = harness.ctx.verifier.reputation

    def one(primary: Node = x, checker: Node = y, step: int = 3, at: int = 5):  # noqa: ANN202
        return audits(session, primary, checker, range(step, step + 1), at)

    same = one()
    same[0].checker.CopyFrom(same[0].primary)
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT, lambda: session.report(audits=same), "two different"
    )
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: session.report(audits=one(step=7, at=5)),
        "at its step or later",
    )
    short = one()
    short[0].checker.output_sha256 = b"x"
    await expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: session.report(audits=short), "32 bytes")
    forged = one()
    forged[0].checker.signature = bytes(64)
    await expect(grpc.StatusCode.PERMISSION_DENIED, lambda: session.report(audits=forged), "forged")
    outsider = Node("o", "op-o")
    await expect(
        grpc.StatusCode.PERMISSION_DENIED,
        lambda: session.report(audits=one(checker=outsider)),
        "not granted",
    )
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: session.report(audits=one(primary=y, checker=y2)),
        "one operator",
    )
    too_many = one() * (MAX_AUDITS + 1)
    await expect(
        grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: session.report(audits=too_many), "at most"
    )
    # One report naming a primary step twice.
    twice = one() * 2
    await expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: session.report(audits=twice), "twice")
    assert reputation.record(x.node_id).verified == 0
    assert reputation.record(y.node_id).verified == 0
    # Still serving: a sound audit lands.
    await session.report(audits=one())
    assert reputation.record(x.node_id).verified == 1
