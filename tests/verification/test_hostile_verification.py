"""Hostile input to the Verification service: GetSessionRisk (which no other test feeds bad
input), and huge or empty session and job ids on every report, with messages over the
size limit.

Clients call these with the capability of a session or job they opened, so a genuine
capability can come with any id. Each refusal carries the right status and a short
message, nothing is recorded, and the coordinator goes on serving: a good query lands.
"""

from __future__ import annotations

import time

import grpc
import pytest
from support.coordinator_harness import Harness
from support.hostile import huge, refused
from verification.test_report_bad_input import Node, Session, open_session

from protos import codec, identity
from protos.tessera.v1 import client_api_pb2, verification_pb2

HUGE = huge("s")


@pytest.fixture
async def session(start_harness) -> Session:
    harness: Harness = await start_harness(canary_interval_s=0.0)
    return open_session(harness, [Node("x", "op-x"), Node("y", "op-y")])


def risk_request(session: Session, **fields: object) -> verification_pb2.SessionRiskRequest:
    fields.setdefault("session_id", session.session_id)
    fields.setdefault("capability", session.capability)
    return verification_pb2.SessionRiskRequest(**fields)  # type: ignore[arg-type]


async def test_get_session_risk_refuses_bad_capabilities_and_ids(session: Session) -> None:
    stub, key = session.stub, session.harness.ctx.signing_key
    claims = client_api_pb2.CapabilityClaims.FromString(session.capability.claims)
    forged = identity.sign_capability(identity.generate_private_key(), claims)
    claims.expires_unix_ms = int(time.time() * 1000) - 1
    expired = identity.sign_capability(key, claims)
    garbage = client_api_pb2.SignedCapability(claims=b"\xff" * 1000, signature=b"\x00" * 7)
    cases = [
        (verification_pb2.SessionRiskRequest(), grpc.StatusCode.UNAUTHENTICATED, "not signed"),
        (risk_request(session, capability=garbage), grpc.StatusCode.UNAUTHENTICATED, "not signed"),
        (risk_request(session, capability=forged), grpc.StatusCode.UNAUTHENTICATED, "not signed"),
        (risk_request(session, capability=expired), grpc.StatusCode.UNAUTHENTICATED, "expired"),
        (risk_request(session, session_id=HUGE), grpc.StatusCode.PERMISSION_DENIED, "another"),
        (risk_request(session, session_id=""), grpc.StatusCode.PERMISSION_DENIED, "another"),
        (
            risk_request(session, session_id="x" * (codec.MAX_MESSAGE_BYTES + 10)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
    ]
    for request, code, words in cases:
        await refused(stub.GetSessionRisk(request, timeout=10), code, words)

    # Still serving: the session's own query answers, and nothing was counted.
    risk = await stub.GetSessionRisk(risk_request(session), timeout=10)
    assert (risk.session_id, risk.calls, risk.checked) == (session.session_id, 0, 0)


async def test_reports_refuse_huge_and_empty_ids_briefly(session: Session) -> None:
    stub = session.stub
    await refused(
        stub.Report(
            verification_pb2.VerificationReport(session_id=HUGE, capability=session.capability)
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "another session",
    )
    for job_id in (HUGE, ""):
        await refused(
            stub.ReportTrainingChecks(
                verification_pb2.TrainingChecks(job_id=job_id, capability=session.capability)
            ),
            grpc.StatusCode.NOT_FOUND,
            "no job",
        )
        await refused(
            stub.ReportTrainingDispute(
                verification_pb2.TrainingDispute(job_id=job_id, capability=session.capability)
            ),
            grpc.StatusCode.NOT_FOUND,
            "no job",
        )
    oversized = verification_pb2.TrainingChecks(job_id="j" * (codec.MAX_MESSAGE_BYTES + 10))
    await refused(
        stub.ReportTrainingChecks(oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"
    )

    # Still serving: an empty report of the session's own lands.
    verdict = await session.report()
    assert not verdict.verdicts and verdict.risk.session_id == session.session_id
