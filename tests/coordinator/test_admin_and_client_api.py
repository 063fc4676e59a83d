"""Admin authentication, DrainNode, ListNodes, and delegation to optional components."""

from __future__ import annotations

import grpc
import pytest
from support.coordinator_harness import Harness
from support.hostile import refused

from coordinator.admin_auth import bearer_metadata
from coordinator.cli import build_parser
from coordinator.node_state import NodeState
from coordinator.secrets_store import new_admin_token
from protos import codec
from protos.tessera.v1 import admin_pb2, client_api_pb2, common_pb2, coordinator_pb2, node_pb2


def drain_request(node_id: str, reason: str = "maintenance") -> admin_pb2.DrainNodeRequest:
    return admin_pb2.DrainNodeRequest(node_id=node_id, reason=reason)


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        ((), "without credentials"),
        ((("authorization", "Bearer wrong-token"),), "wrong admin token"),
        ((("authorization", "Basic abc"),), "Bearer"),
        ((("authorization", "Bearer "),), "wrong admin token"),
    ],
    ids=["missing", "wrong", "wrong-scheme", "empty"],
)
async def test_admin_calls_need_the_token(harness: Harness, metadata, fragment: str) -> None:
    node = await harness.registered_node(attach=True)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.admin.DrainNode(drain_request(node.node_id), metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert fragment in info.value.details()
    assert harness.state(node.node_id) is NodeState.ONLINE
    # The streaming admin RPC checks the token before touching the stream.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.admin.AddModel(iter([admin_pb2.AddModelChunk()]), metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_drain_node_sends_the_command_and_marks_draining(harness: Harness) -> None:
    node = await harness.registered_node(attach=True)
    await harness.admin.DrainNode(
        drain_request(node.node_id, "disk swap"), metadata=bearer_metadata(harness.ctx.admin_token)
    )
    message = await node.call.read()
    assert message.command.drain.reason == "disk swap"
    assert message.command.drain.deadline_ms > 0
    assert harness.state(node.node_id) is NodeState.DRAINING


async def test_drain_unknown_or_offline_node(harness: Harness) -> None:
    auth = bearer_metadata(harness.ctx.admin_token)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.admin.DrainNode(drain_request("n-nobody"), metadata=auth)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    offline = await harness.registered_node("offline-node")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.admin.DrainNode(drain_request(offline.node_id), metadata=auth)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "offline" in info.value.details()


async def test_drain_refuses_hostile_input_and_keeps_serving(harness: Harness) -> None:
    auth = bearer_metadata(harness.ctx.admin_token)
    node = await harness.registered_node(attach=True)

    def drain(request: admin_pb2.DrainNodeRequest) -> object:
        return harness.admin.DrainNode(request, metadata=auth)

    await refused(drain(drain_request("")), grpc.StatusCode.INVALID_ARGUMENT, "node_id is empty")
    await refused(drain(drain_request("n" * 100_000 + "\n")), grpc.StatusCode.NOT_FOUND, "")
    huge = drain_request(node.node_id, "x" * (codec.MAX_MESSAGE_BYTES + 10))
    await refused(drain(huge), grpc.StatusCode.RESOURCE_EXHAUSTED, "")
    assert harness.state(node.node_id) is NodeState.ONLINE  # nothing of that reached it

    # A long reason with line breaks still drains: the node is told at most 200 characters.
    await harness.admin.DrainNode(drain_request(node.node_id, "disk\nswap " * 5_000), metadata=auth)
    message = await node.call.read()
    assert message.command.drain.reason.startswith("disk\nswap")
    assert len(message.command.drain.reason) == 200
    assert harness.state(node.node_id) is NodeState.DRAINING


async def test_admin_token_is_private_and_stable(harness: Harness) -> None:
    path = harness.ctx.data_dir / "admin.token"
    assert path.read_text().strip() == harness.ctx.admin_token
    assert path.stat().st_mode & 0o777 == 0o600
    key = harness.ctx.data_dir / "coordinator.key"
    assert key.stat().st_mode & 0o777 == 0o600


def test_generated_admin_tokens_can_follow_the_flag_on_a_command_line() -> None:
    """`--admin-token TOKEN` as printed in --help: a token starting with "-" would read as
    a missing value (bare urlsafe tokens do 1 time in 64; a test failed on one)."""
    parser = build_parser()
    for _ in range(500):
        token = new_admin_token()
        assert not token.startswith("-")
        args = parser.parse_args(["models", "add", "ckpt", "--admin-token", token])
        assert args.admin_token == token


async def test_list_nodes_hides_offline_unless_asked(harness: Harness) -> None:
    online = await harness.registered_node("b-online", attach=True)
    offline = await harness.registered_node("a-offline")
    await online.heartbeat(1, node_pb2.Telemetry(active_sessions=2))

    listed = await harness.client_api.ListNodes(client_api_pb2.ListNodesRequest())
    assert [n.node_id for n in listed.nodes] == [online.node_id]
    info = listed.nodes[0]
    assert info.state == node_pb2.NODE_STATE_ONLINE
    assert info.capabilities.matmul_tflops == 35.5
    assert info.telemetry.active_sessions == 2
    assert info.registered_unix_ms > 0 and info.last_seen_unix_ms >= info.registered_unix_ms

    everything = await harness.client_api.ListNodes(
        client_api_pb2.ListNodesRequest(include_offline=True)
    )
    assert [n.name for n in everything.nodes] == ["a-offline", "b-online"]
    assert everything.nodes[0].node_id == offline.node_id


class RecordingSessions:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def open_session(self, request, context):
        self.calls.append(f"open:{request.model}")
        return client_api_pb2.SessionGrant(session_id="s1", num_layers=4)

    async def close_session(self, request, context):
        self.calls.append(f"close:{request.session_id}")
        return common_pb2.Empty()

    async def reroute(self, request, context):
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such session")


async def test_session_rpcs_delegate_or_answer_unimplemented(harness: Harness) -> None:
    harness.ctx.sessions = None
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.client_api.OpenSession(client_api_pb2.OpenSessionRequest(model="m"))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "session" in info.value.details()

    sessions = RecordingSessions()
    harness.ctx.sessions = sessions
    grant = await harness.client_api.OpenSession(client_api_pb2.OpenSessionRequest(model="m"))
    assert grant.session_id == "s1"
    await harness.client_api.CloseSession(client_api_pb2.CloseSessionRequest(session_id="s1"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.client_api.Reroute(client_api_pb2.RerouteRequest(session_id="zz"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert sessions.calls == ["open:m", "close:s1"]


async def test_model_rpcs_answer_unimplemented_without_a_store(harness: Harness) -> None:
    harness.ctx.model_store = None
    for call in (
        harness.client_api.ListModels(common_pb2.Empty()),
        harness.client_api.GetModel(common_pb2.ModelRef(name="m")),
        harness.coordinator_stub.GetManifest(common_pb2.ModelRef(name="m")),
        harness.admin.RemoveModel(
            common_pb2.ModelRef(name="m"), metadata=bearer_metadata(harness.ctx.admin_token)
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "model store" in info.value.details()
    stream = harness.coordinator_stub.FetchTensors(coordinator_pb2.FetchRequest(model="m"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stream:
            pass
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def moderation(node_id: str, reason: str = "spams sessions") -> admin_pb2.NodeModerationRequest:
    return admin_pb2.NodeModerationRequest(node_id=node_id, reason=reason)


async def test_an_operator_bans_a_node_and_lifts_the_ban(harness: Harness) -> None:
    auth = bearer_metadata(harness.ctx.admin_token)
    node = await harness.registered_node("moderated", attach=True)
    reputation = harness.ctx.verifier.reputation
    for _ in range(400):  # a trusted node: checked at the floor rate
        reputation.verified(node.node_id)
    assert reputation.probability(node.node_id) == 0.05
    await harness.admin.BanNode(moderation(node.node_id), metadata=auth)
    assert harness.state(node.node_id) is NodeState.BANNED
    with pytest.raises(grpc.aio.AioRpcError) as info:  # its stream is closed
        await node.call.read()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == "node banned: by an operator: 'spams sessions'"
    listed = await harness.client_api.ListNodes(
        client_api_pb2.ListNodesRequest(include_offline=True)
    )
    assert [n.state_reason for n in listed.nodes] == ["by an operator: 'spams sessions'"]
    with pytest.raises(grpc.aio.AioRpcError) as info:  # and its key may not come back
        await node.register()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Banned once: a second ban is refused and keeps the first reason on record.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await harness.admin.BanNode(moderation(node.node_id, "again"), metadata=auth)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "banned already" in info.value.details()

    await harness.admin.UnbanNode(moderation(node.node_id, "owner fixed it"), metadata=auth)
    assert harness.state(node.node_id) is NodeState.OFFLINE
    # Back, it earns trust again from the start; its record stays.
    assert reputation.probability(node.node_id) == 1.0
    assert reputation.record(node.node_id).verified == 400
    await node.register()
    await node.attach()
    assert harness.state(node.node_id) is NodeState.ONLINE
    with pytest.raises(grpc.aio.AioRpcError) as info:  # no ban to lift now
        await harness.admin.UnbanNode(moderation(node.node_id), metadata=auth)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "is online, not banned" in info.value.details()


@pytest.mark.parametrize("method", ["BanNode", "UnbanNode"])
async def test_ban_and_unban_refuse_strangers_and_hostile_input(harness: Harness, method) -> None:
    auth = bearer_metadata(harness.ctx.admin_token)
    node = await harness.registered_node(attach=True)
    call = getattr(harness.admin, method)

    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    await refused(call(moderation(node.node_id)), unauthenticated, "without credentials")
    wrong = (("authorization", "Bearer guess"),)
    await refused(call(moderation(node.node_id), metadata=wrong), unauthenticated, "wrong")
    empty = call(moderation(""), metadata=auth)
    await refused(empty, grpc.StatusCode.INVALID_ARGUMENT, "node_id is empty")
    await refused(
        call(moderation("n" * 100_000 + "\n"), metadata=auth), grpc.StatusCode.NOT_FOUND, ""
    )
    huge = moderation(node.node_id, "x" * (codec.MAX_MESSAGE_BYTES + 10))
    await refused(call(huge, metadata=auth), grpc.StatusCode.RESOURCE_EXHAUSTED, "")
    assert harness.state(node.node_id) is NodeState.ONLINE  # nothing of that reached it
    if method == "BanNode":  # a long reason with line breaks is cut and quoted on record
        await call(moderation(node.node_id, "a\nb " * 5_000), metadata=auth)
        assert harness.state(node.node_id) is NodeState.BANNED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await node.call.read()
        assert "'a\\nb a\\nb" in info.value.details() and len(info.value.details()) < 400
