"""A restarted coordinator takes back its saved plans and measurements, and waits for the
nodes its plans place before it re-plans, even when its database has them offline (a
coordinator that died moments after they re-attached, before the registry recorded
them)."""

import asyncio
from pathlib import Path

import grpc
from support.coordinator_harness import CHANNEL_OPTIONS, FakeNode, harness_settings, wait_until

from coordinator.db import open_database
from coordinator.measurements import Measurements
from coordinator.plan_store import PlanStore
from coordinator.planner import ModelPlan, Shard
from coordinator.server import running_coordinator
from protos.tessera.v1 import coordinator_pb2_grpc, node_pb2


def saved_models(db_path: Path) -> set[str]:
    db = open_database(db_path)
    try:
        return {row[0] for row in db.execute("SELECT model FROM placement_plans")}
    finally:
        db.close()


async def test_a_restart_waits_for_every_node_its_saved_plans_place(tmp_path: Path) -> None:
    settings = harness_settings(tmp_path, reattach_grace_s=30.0)
    async with running_coordinator(settings) as first:
        channel = grpc.aio.insecure_channel(first.address, options=CHANNEL_OPTIONS)
        nodes = [FakeNode(channel, f"n{i}") for i in range(2)]
        for node in nodes:
            await node.register()  # known to the registry, never attached: offline
        await channel.close()
    a, b = (n.node_id for n in nodes)
    plan = ModelPlan("m", [0, 4], {a: Shard("m", 0, 2), b: Shard("m", 2, 4)}, [(a, b)])
    measured = Measurements()
    for _ in range(10):
        measured.observe_step(a, layers=2, params_per_layer=10**8, tokens=1, compute_ms=4.0)
    db = open_database(settings.db_path)
    PlanStore(db).save({"m": plan}, measured)
    db.close()

    async with running_coordinator(settings) as second:
        assert second.ctx.registry.returning == [], "the database has no one online"
        # The speeds the plan was made with came back too.
        assert second.ctx.planner.measurements.snapshot(a) == measured.snapshot(a)
        await asyncio.sleep(0.5)
        # A re-plan now would see no node and no model (none was imported here), and
        # replace the saved plan with nothing.
        assert saved_models(settings.db_path) == {"m"}, "it re-planned without its nodes"
        channel = grpc.aio.insecure_channel(second.address, options=CHANNEL_OPTIONS)
        try:
            for node in nodes:
                node.stub = coordinator_pb2_grpc.CoordinatorStub(channel)  # same key, new link
                await node.register()
                await node.attach()
                await node.heartbeat(1, telemetry=node_pb2.Telemetry())
            # Both are back and have reported: the re-plan runs.
            await wait_until(lambda: saved_models(settings.db_path) == set(), 5.0,
                             "the re-plan once the nodes are back")  # fmt: skip
        finally:
            for node in nodes:
                if node.call is not None:
                    node.call.cancel()
            await channel.close()
