"""A restarted coordinator keeps the swarm's placement: it starts from its saved plans and
waits for the nodes that were online to come back before it re-plans."""

import asyncio
import time
from pathlib import Path

from planner.test_placement_and_sessions import CONFIG, Swarm, caps

from coordinator.db import open_database
from coordinator.placement import Placement, PlacementNode, model_spec, node_spec
from coordinator.plan_store import PlanStore
from coordinator.planner import ModelSpec, plan
from coordinator.sessions import Sessions
from protos import identity
from protos.tessera.v1 import client_api_pb2, common_pb2, node_pb2

NODES = ("n0", "n1", "n2", "n3")
SPEED = {"n0": 1.0, "n1": 1.0, "n2": 1.0, "n3": 4.0}


def node(node_id: str) -> PlacementNode:
    return PlacementNode(node_id, f"127.0.0.1:{9000 + NODES.index(node_id)}",
                         caps(tflops=SPEED[node_id]))  # fmt: skip


async def report(placement: Placement, node_id: str, start: int, end: int) -> None:
    await placement.shard_status(
        node_id,
        node_pb2.ShardStatus(model="m", layers=common_pb2.LayerRange(start=start, end=end),
                             state=node_pb2.SHARD_STATE_READY),
    )  # fmt: skip


def assigned(swarm: Swarm) -> dict[str, tuple[int, int]]:
    """Each node's newest assignment."""
    return {n: (s, e) for n, kind, s, e in swarm.commands if kind == "assign"}


async def history_made_placement(tmp_path: Path) -> tuple[dict[str, tuple[int, int]], Path]:
    """A 3-stage layout cut for n0-n2, then n3 (4x faster) joining as a replica: a history
    that a plan made from scratch with all four nodes would not repeat. The plans are
    saved in a real database, as the coordinator does."""
    db_path = tmp_path / "coordinator.db"
    store = PlanStore(open_database(db_path))
    swarm = Swarm()
    first = Placement(swarm.send, replicas=2, min_stages=3, debounce_s=0, on_plans=store.save)
    first.set_models([model_spec("m", CONFIG)])
    for node_id in NODES[:3]:
        first.node_up(node(node_id))
    await first.replan()
    first.node_up(node("n3"))
    await first.replan()
    served = assigned(swarm)
    assert set(served) == set(NODES)
    fresh = plan(
        [model_spec("m", CONFIG)],
        [node_spec(node(n), first.kv_tokens) for n in NODES],
        replicas=2,
        min_stages=3,
    )["m"]
    assert {n: (s.start, s.end) for n, s in fresh.holders.items()} != served, (
        "the test needs a placement that planning afresh would change"
    )
    return served, db_path


def restarted_placement(db_path: Path, grace_s: float) -> tuple[Swarm, Placement]:
    """A placement as a coordinator restarted on `db_path` sets it up."""
    swarm = Swarm()
    restarted = Placement(swarm.send, replicas=2, min_stages=3, debounce_s=0)
    restarted.restore(PlanStore(open_database(db_path)).load())
    restarted.await_returning(NODES, grace_s=grace_s)
    restarted.set_models([model_spec("m", CONFIG)])
    return swarm, restarted


async def come_back(placement: Placement, node_id: str, shard: tuple[int, int]) -> None:
    """The node re-attaches, reports the shard it serves, then its first telemetry."""
    placement.node_up(node(node_id))
    await report(placement, node_id, *shard)
    placement.node_reported(node_id)


async def test_a_restarted_coordinator_keeps_every_shard_where_it_was(tmp_path):
    served, db_path = await history_made_placement(tmp_path)
    swarm, restarted = restarted_placement(db_path, grace_s=30)
    # The nodes come back one by one, the fast one first.
    for node_id in ("n3", "n0"):
        await come_back(restarted, node_id, served[node_id])
        await asyncio.sleep(0.05)
        assert assigned(swarm) == {}, "a re-plan while nodes are still coming back moves shards"
    # Meanwhile sessions are served from what the nodes that are back hold.
    info = client_api_pb2.ModelInfo(name="m", num_layers=6, hidden_size=64, vocab_size=100)
    sessions = Sessions(identity.generate_private_key(), restarted, lambda n: info,
                        lambda: ["m"])  # fmt: skip
    grant = sessions.open_session(client_api_pb2.OpenSessionRequest(model="m", max_length=8))
    assert {s.primary.node_id for s in grant.stages} <= {"n0", "n3"}

    for node_id in ("n1", "n2"):
        await come_back(restarted, node_id, served[node_id])
    await asyncio.wait_for(restarted.settled(), 5)
    assert assigned(swarm) == served, "every node keeps the shard it held"
    assert not [c for c in swarm.commands if c[1] == "drop"]


async def test_nodes_that_do_not_come_back_are_planned_around_after_the_grace(tmp_path):
    served, db_path = await history_made_placement(tmp_path)
    started = time.monotonic()
    swarm, restarted = restarted_placement(db_path, grace_s=0.5)
    gone = next(n for n in NODES[:3] if served[n] != served["n3"])  # a pipeline stage
    for node_id in NODES:
        if node_id != gone:
            await come_back(restarted, node_id, served[node_id])
    await asyncio.wait_for(restarted.settled(), 5)
    assert time.monotonic() - started >= 0.5, "the re-plan waited out the grace"
    now = assigned(swarm)
    assert gone not in now
    for node_id in NODES[:3]:
        if node_id != gone:
            assert now.get(node_id, served[node_id]) == served[node_id], "survivors stay put"
    model_plan = restarted.plan_of("m")
    assert model_plan is not None and not model_plan.missing_layers()


async def test_a_coordinator_with_no_one_to_wait_for_plans_at_once():
    swarm = Swarm()
    placement = Placement(swarm.send, replicas=2, min_stages=3, debounce_s=0)
    placement.await_returning((), grace_s=30)
    placement.set_models([model_spec("m", CONFIG)])
    for node_id in NODES[:3]:
        placement.node_up(node(node_id))
    await asyncio.wait_for(placement.settled(), 1)
    assert set(assigned(swarm)) == set(NODES[:3])


async def test_a_layout_sized_by_measured_speeds_survives_with_its_measurements(tmp_path):
    # n0 claims a fifth of n1's speed (a benchmark that undersold it) but was measured 5x
    # faster, so the plan gave it most layers. Planned again with the claims alone, that
    # layout looks 1.8x slower than a fresh one, which moves 4 of these 1B-parameter
    # layers each way (the planner reckons half an hour of downloads) and is chosen.
    spec = ModelSpec("m", num_layers=6, params_per_layer=10**9, embed_params=5 * 10**8,
                     head_params=5 * 10**8, kv_values_per_token_per_layer=1024)  # fmt: skip
    claims = {"n0": caps(gb=26, tflops=0.2), "n1": caps(gb=26, tflops=1.0)}  # 5 layers each
    measured_ms_per_gparam = {"n0": 0.4, "n1": 2.0}
    db_path = tmp_path / "coordinator.db"
    store = PlanStore(open_database(db_path))

    def started(swarm: Swarm, store: PlanStore | None = None) -> Placement:
        p = Placement(swarm.send, replicas=1, min_stages=1, debounce_s=0,
                      on_plans=store.save if store else None)  # fmt: skip
        p.set_models([spec])
        for i, (node_id, c) in enumerate(claims.items()):
            p.node_up(PlacementNode(node_id, f"127.0.0.1:{9000 + i}", c))
        return p

    first_swarm = Swarm()
    first = started(first_swarm, store)
    for _ in range(10):
        for node_id, ms in measured_ms_per_gparam.items():
            first.measurements.observe_step(node_id, layers=1, params_per_layer=10**9,
                                            tokens=1, compute_ms=ms)  # fmt: skip
    await first.replan()
    served = assigned(first_swarm)
    assert served["n0"][1] - served["n0"][0] == 5, f"the fast node holds most layers: {served}"

    async def restarted(with_measurements: bool) -> dict[str, tuple[int, int]]:
        swarm = Swarm()
        again = started(swarm)
        saved = PlanStore(open_database(db_path))
        again.restore(saved.load())
        if with_measurements:
            saved.load_measurements(again.measurements)
        for node_id, shard in served.items():
            await report(again, node_id, *shard)
        await again.replan()
        return assigned(swarm)

    assert await restarted(with_measurements=False) != served, (
        "the test needs a layout that the claims alone would move"
    )
    assert await restarted(with_measurements=True) == served
