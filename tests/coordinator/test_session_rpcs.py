"""Session RPCs over real gRPC: malformed, oversized and hostile requests get a clear status
and the coordinator keeps serving."""

from __future__ import annotations

import time

import grpc
import pytest

from protos import identity
from protos.tessera.v1 import client_api_pb2, common_pb2


async def expect(code: grpc.StatusCode, call, fragment: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    assert fragment in (err.value.details() or "")
    return err.value.details() or ""


async def test_open_session_refuses_bad_requests(harness):
    api = harness.client_api
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        api.OpenSession(client_api_pb2.OpenSessionRequest(max_length=8)),
        "model name",
    )
    await expect(
        grpc.StatusCode.NOT_FOUND,
        api.OpenSession(client_api_pb2.OpenSessionRequest(model="ghost", max_length=8)),
        "unknown model 'ghost'",
    )
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        api.OpenSession(client_api_pb2.OpenSessionRequest(model="x" * 100_000)),
        "model name",
    )
    # Still serving.
    assert (await api.ListNodes(client_api_pb2.ListNodesRequest())).nodes == []


async def test_reroute_and_close_refuse_forged_foreign_and_expired_capabilities(harness):
    api = harness.client_api
    ours = harness.ctx.signing_key
    theirs = identity.generate_private_key()
    now = int(time.time() * 1000)
    claims = client_api_pb2.CapabilityClaims(
        session_id="s1", model="m", max_tokens=8, expires_unix_ms=now + 60_000
    )
    forged = identity.sign_capability(theirs, claims)
    await expect(
        grpc.StatusCode.UNAUTHENTICATED,
        api.Reroute(client_api_pb2.RerouteRequest(session_id="s1", capability=forged)),
        "not signed by this coordinator",
    )
    garbage = client_api_pb2.SignedCapability(claims=b"\xff" * 40, signature=b"\x00" * 64)
    await expect(
        grpc.StatusCode.UNAUTHENTICATED,
        api.CloseSession(client_api_pb2.CloseSessionRequest(session_id="s1", capability=garbage)),
    )
    genuine = identity.sign_capability(ours, claims)
    await expect(
        grpc.StatusCode.PERMISSION_DENIED,
        api.CloseSession(client_api_pb2.CloseSessionRequest(session_id="s2", capability=genuine)),
        "another session",
    )
    expired = identity.sign_capability(
        ours, client_api_pb2.CapabilityClaims(session_id="s1", model="m", expires_unix_ms=now - 1)
    )
    await expect(
        grpc.StatusCode.UNAUTHENTICATED,
        api.Reroute(client_api_pb2.RerouteRequest(session_id="s1", capability=expired)),
        "expired",
    )
    # A genuine capability for an unknown model, with a span outside it.
    await expect(
        grpc.StatusCode.NOT_FOUND,
        api.Reroute(
            client_api_pb2.RerouteRequest(
                session_id="s1", capability=genuine, span=common_pb2.LayerRange(start=5, end=1)
            )
        ),
        "unknown model",
    )
    assert (
        await api.CloseSession(
            client_api_pb2.CloseSessionRequest(session_id="s1", capability=genuine)
        )
        == client_api_pb2.CloseSessionResponse()
    )
