"""A merged hop's comparison can be reported: its span is granted as consecutive stages.

A check of a merged hop compares outputs signed for the joined span, while the session's
capability grants each node the route's stages one by one. The coordinator accepts the
evidence when a node's grants cover the span without a gap, and refuses it otherwise.
Real gRPC against an in-process coordinator (the report tests' harness).
"""

from __future__ import annotations

import time

import grpc
import pytest
from verification.test_report_bad_input import LAYERS, Node, Session, agreement, expect

from protos import identity
from protos.tessera.v1 import client_api_pb2, common_pb2, verification_pb2_grpc


def staged_session(harness, stages: dict[str, list[tuple[int, int]]], nodes: list[Node]) -> Session:
    """A session granting each node its stages (node name -> [(start, end)])."""
    now = int(time.time() * 1000)
    claims = client_api_pb2.CapabilityClaims(
        session_id="s-merged",
        model="tiny",
        grants=[
            client_api_pb2.Hop(
                node_id=n.node_id,
                layers=common_pb2.LayerRange(start=start, end=end),
                public_key=n.public_key,
                account=n.account,
                device_kind="cpu",
                compute_dtype="float32",
            )
            for n in nodes
            for start, end in stages[n.name]
        ],
        issued_unix_ms=now,
        expires_unix_ms=now + 600_000,
        max_tokens=64,
    )
    capability = identity.sign_capability(harness.ctx.signing_key, claims)
    stub = verification_pb2_grpc.VerificationStub(harness.channel)
    return Session(harness, "s-merged", capability, stub)


@pytest.mark.parametrize(
    ("checker_stages", "accepted"),
    [
        ([(0, 2), (2, 4)], True),  # two stages that join without a gap
        ([(2, 4), (0, 3)], True),  # overlapping, in any order
        ([(0, 1), (2, 4)], False),  # a gap at layer 1
        ([(0, 2)], False),  # only part of the span
    ],
)
async def test_a_merged_span_counts_when_the_grants_cover_it_without_a_gap(
    start_harness, checker_stages, accepted
) -> None:
    assert LAYERS == (0, 4)
    harness = await start_harness(canary_interval_s=0.0)
    x, y = Node("x", "op-x"), Node("y", "op-y")
    session = staged_session(harness, {"x": [(0, 2), (2, 4)], "y": checker_stages}, [x, y])
    comparison = agreement(session, x, y, 1)
    reputation = harness.ctx.verifier.reputation
    if accepted:
        await session.report(comparison)
        assert reputation.record(x.node_id).consecutive == 1
    else:
        await expect(
            grpc.StatusCode.PERMISSION_DENIED,
            lambda: session.report(comparison),
            "was not granted layers [0, 4)",
        )
        assert reputation.record(x.node_id).consecutive == 0
