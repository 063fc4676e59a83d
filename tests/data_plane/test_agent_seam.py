"""The seams to the node agent: its plug-in entry points, and fetching from the real store.

The agent builds `build_shard_handler(ctx)` first and then the stage server from the same
context; both must share one ShardManager, which also feeds the heartbeat telemetry. A
shard is fetched from the real coordinator's model store through node_agent.shard_fetcher.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from data_plane.stage_harness import MODEL, NUM_LAYERS, OPTIONS, CoordinatorKeys, node_context
from support.coordinator_harness import FakeNode, harness_settings

from coordinator import models_cli
from coordinator.server import running_coordinator
from node_agent.context import AgentContext
from node_agent.data_plane import start_server
from node_agent.shard_handler import ShardHandler
from node_agent.shard_manager import ShardManager, build_shard_handler
from node_agent.stage_server import StageServicer, build_stage_servicer
from node_agent.telemetry import merge
from protos import identity
from protos.tessera.v1 import common_pb2, coordinator_pb2, node_pb2, stage_pb2, stage_pb2_grpc


def test_plugins_share_one_shard_manager(tmp_path: Path) -> None:
    ctx = node_context(tmp_path, CoordinatorKeys().public)
    handler = build_shard_handler(ctx)
    ctx.shard_handler = handler  # what the agent does with it
    servicer = build_stage_servicer(ctx)
    assert isinstance(handler, ShardManager) and isinstance(handler, ShardHandler)
    assert isinstance(servicer, StageServicer)
    assert servicer._shards is handler
    assert build_shard_handler(ctx) is handler
    assert ctx.telemetry_sources.count(handler) == 1
    handler.close()


async def test_the_agents_own_server_serves_our_stage(tmp_path: Path) -> None:
    keys = CoordinatorKeys()
    ctx = node_context(tmp_path, keys.public)
    ctx.shard_handler = build_shard_handler(ctx)
    server, port = await start_server(ctx, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            assert (await stub.Ping(stage_pb2.PingRequest(payload=b"p"))).node_id == ctx.node_id
            call = stub.Forward()
            await call.write(
                stage_pb2.ForwardRequest(
                    capability=keys.capability("s", [(ctx.node_id, 0, NUM_LAYERS)]),
                    session_id="s",
                    model=MODEL,
                    layers=common_pb2.LayerRange(start=0, end=NUM_LAYERS),
                )
            )
            try:
                await call.read()
                raise AssertionError("a node without shards must refuse")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(0)
        ctx.shard_handler.close()


async def test_assign_fetches_the_shard_from_the_coordinators_store(
    tmp_path: Path, checkpoint: Path
) -> None:
    settings = harness_settings(tmp_path / "coordinator")
    async with running_coordinator(settings) as coordinator:
        address = coordinator.address
        added = await asyncio.to_thread(
            models_cli.main,
            [
                "models",
                "add",
                str(checkpoint),
                "--name",
                MODEL,
                "--coordinator",
                address,
                "--admin-token",
                coordinator.ctx.admin_token,
            ],
        )
        assert added == 0
        async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
            registered = FakeNode(channel, "fetching-node")
            await registered.register()
        ctx = AgentContext(
            **{
                **node_context(tmp_path / "node", b"").__dict__,
                "node_id": registered.node_id,
                "private_key": registered.key,
                "coordinator_address": address,
                "attach_ticket": registered.ticket,
                "telemetry_sources": [],
            }
        )
        assert identity.node_id(identity.public_key_bytes(ctx.private_key)) == ctx.node_id
        manager = build_shard_handler(ctx)
        statuses: list[node_pb2.ShardStatus] = []
        command = coordinator_pb2.AssignShard(
            model=MODEL,
            layers=common_pb2.LayerRange(start=1, end=3),
            dtype="float32",
            kv_tokens_budget=256,
            num_layers=NUM_LAYERS,
        )
        await manager.assign(command, statuses.append)
        assert statuses[-1].state == node_pb2.SHARD_STATE_READY, statuses[-1].error
        fetching = [s for s in statuses if s.state == node_pb2.SHARD_STATE_FETCHING]
        assert fetching and fetching[-1].progress == 1.0 and fetching[-1].bytes_fetched > 0
        assert (tmp_path / "node" / "shards" / MODEL / "1-3" / "config.json").is_file()
        assert manager.find(MODEL, 1, 3) is not None
        assert merge(ctx.telemetry_sources).kv_tokens_budget == 256
        manager.close()
