"""Hostile input to the ClientApi, which anyone can call: huge and control-character names
and session ids, and messages over the size limit.

Each is refused with the right status and a short message (error details travel in gRPC
metadata, which a client refuses past 16 KiB: a message that repeats a huge name arrives
as RESOURCE_EXHAUSTED "Stream removed" instead of the real reason), and the coordinator
goes on serving.
"""

from __future__ import annotations

import time

import grpc
from support.coordinator_harness import Harness
from support.hostile import huge, refused

from protos import codec, identity
from protos.tessera.v1 import client_api_pb2, common_pb2

HUGE = huge("m")


async def test_get_model_refuses_hostile_names_briefly(harness: Harness) -> None:
    api = harness.client_api
    details = await refused(
        api.GetModel(common_pb2.ModelRef(name=HUGE)), grpc.StatusCode.NOT_FOUND, "known models"
    )
    assert "\x1b" not in details and "\n" not in details  # quoted, never raw
    await refused(api.GetModel(common_pb2.ModelRef()), grpc.StatusCode.NOT_FOUND, "no model")
    # Over the 64 MiB message limit: refused by gRPC before the store sees it.
    oversized = common_pb2.ModelRef(name="x" * (codec.MAX_MESSAGE_BYTES + 10))
    await refused(api.GetModel(oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")

    # Still serving.
    assert list((await api.ListModels(common_pb2.Empty())).models) == []
    assert list((await api.ListNodes(client_api_pb2.ListNodesRequest())).nodes) == []


async def test_session_calls_refuse_huge_session_ids_briefly(harness: Harness) -> None:
    """A genuine capability (any client can open a session) sent with another session id."""
    api = harness.client_api
    now = int(time.time() * 1000)
    claims = client_api_pb2.CapabilityClaims(
        session_id="s1", model="m", max_tokens=8, expires_unix_ms=now + 60_000
    )
    genuine = identity.sign_capability(harness.ctx.signing_key, claims)
    calls = [
        api.Reroute(
            client_api_pb2.RerouteRequest(
                session_id=HUGE,
                capability=genuine,
                exclude_node_ids=[HUGE] * 10,
                reason=HUGE,
            )
        ),
        api.CloseSession(client_api_pb2.CloseSessionRequest(session_id=HUGE, capability=genuine)),
        api.ReportStepTimes(
            client_api_pb2.StepTimesReport(
                session_id=HUGE,
                capability=genuine,
                steps=[client_api_pb2.StepTime(node_id=HUGE, tokens=1, wall_ms=1.0)],
            )
        ),
    ]
    for call in calls:
        await refused(call, grpc.StatusCode.PERMISSION_DENIED, "another session")
    oversized = client_api_pb2.CloseSessionRequest(
        session_id="x" * (codec.MAX_MESSAGE_BYTES + 10), capability=genuine
    )
    await refused(
        api.CloseSession(oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"
    )

    # Still serving: the session's own close goes through.
    closed = await api.CloseSession(
        client_api_pb2.CloseSessionRequest(session_id="s1", capability=genuine)
    )
    assert closed == client_api_pb2.CloseSessionResponse()
