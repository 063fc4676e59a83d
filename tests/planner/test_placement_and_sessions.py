"""Placement drives nodes through commands; sessions route over READY shards with tokens."""

import asyncio
import json
import time

import grpc
import pytest

from coordinator.placement import Placement, PlacementNode, model_spec, node_spec
from coordinator.planner import ModelPlan, pipeline_seconds
from coordinator.sessions import SessionError, Sessions
from protos import identity
from protos.tessera.v1 import client_api_pb2, common_pb2, node_pb2

CONFIG = json.dumps(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
    }
)


def caps(gb: float = 4.0, tflops: float = 1.0) -> node_pb2.Capabilities:
    return node_pb2.Capabilities(
        device_kind="cpu", memory_usable_bytes=int(gb * 2**30), matmul_tflops=tflops
    )


class Swarm:
    """Records the commands placement sends, and lets the test report shard states."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, str, int, int]] = []
        self.probes: dict[str, list[tuple[str, str]]] = {}  # node -> (peer id, address)

    async def send(self, node_id: str, command) -> bool:
        kind = command.WhichOneof("kind")
        body = getattr(command, kind)
        if kind == "probe":
            self.probes[node_id] = [(p.node_id, p.address) for p in body.peers]
            return True
        self.commands.append((node_id, kind, body.layers.start, body.layers.end))
        return True


class ReplanCounter:
    """Counts the re-plans placement runs from now on, the debounced ones included."""

    def __init__(self, placement: Placement) -> None:
        self.count = 0
        self._replan = placement.replan
        placement.replan = self._counted  # type: ignore[method-assign]

    async def _counted(self) -> None:
        self.count += 1
        await self._replan()


async def ready_all(placement: Placement, swarm: Swarm) -> None:
    for node_id, kind, start, end in list(swarm.commands):
        if kind == "assign":
            await placement.shard_status(
                node_id,
                node_pb2.ShardStatus(
                    model="m",
                    layers=common_pb2.LayerRange(start=start, end=end),
                    state=node_pb2.SHARD_STATE_READY,
                ),
            )


def make(min_stages: int = 3):
    swarm = Swarm()
    placement = Placement(swarm.send, replicas=2, min_stages=min_stages, debounce_s=0)
    spec = model_spec("m", CONFIG)
    placement.set_models([spec])
    info = client_api_pb2.ModelInfo(name="m", num_layers=6, hidden_size=64, vocab_size=100)
    key = identity.generate_private_key()
    sessions = Sessions(key, placement, lambda n: info if n == "m" else None, lambda: ["m"])
    return swarm, placement, sessions, key


async def test_three_nodes_get_a_three_stage_pipeline_and_sessions_route_it():
    swarm, placement, sessions, key = make()
    for i in range(3):
        placement.node_up(PlacementNode(f"n{i}", f"127.0.0.1:{9000 + i}", caps()))
    await placement.replan()
    assert {c[1] for c in swarm.commands} == {"assign"}
    with pytest.raises(SessionError) as err:  # nothing READY yet
        sessions.open_session(client_api_pb2.OpenSessionRequest(model="m", max_length=32))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    await ready_all(placement, swarm)
    assert placement.coverage("m") == [2] * 6
    grant = sessions.open_session(client_api_pb2.OpenSessionRequest(model="m", max_length=32))
    assert [(s.layers.start, s.layers.end) for s in grant.stages] == [(0, 2), (2, 4), (4, 6)]
    assert len({s.primary.node_id for s in grant.stages}) == 3
    claims = identity.open_capability(identity.public_key_bytes(key), grant.capability)
    assert claims.session_id == grant.session_id and claims.max_tokens == 32
    granted = {(g.node_id, g.layers.start, g.layers.end) for g in claims.grants}
    for s in grant.stages:
        for hop in (s.primary, *s.alternates):
            assert (hop.node_id, hop.layers.start, hop.layers.end) in granted


async def test_a_node_leaving_is_replanned_and_reroute_avoids_it():
    swarm, placement, sessions, _ = make()
    for i in range(3):
        placement.node_up(PlacementNode(f"n{i}", f"127.0.0.1:{9000 + i}", caps()))
    await placement.replan()
    await ready_all(placement, swarm)
    grant = sessions.open_session(client_api_pb2.OpenSessionRequest(model="m", max_length=32))
    middle = grant.stages[1]
    placement.node_down(middle.primary.node_id)
    await placement.replan()
    reply = sessions.reroute(
        client_api_pb2.RerouteRequest(
            session_id=grant.session_id,
            capability=grant.capability,
            span=middle.layers,
            exclude_node_ids=[middle.primary.node_id],
        )
    )
    assert reply.hops and all(h.node_id != middle.primary.node_id for h in reply.hops)
    assert reply.hops[0].layers.start == 2 and reply.hops[-1].layers.end == 4


async def test_unknown_model_and_bad_lengths_and_forged_capabilities_are_refused():
    _, placement, sessions, _ = make()
    with pytest.raises(SessionError) as err:
        sessions.open_session(client_api_pb2.OpenSessionRequest(model="nope", max_length=8))
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "known models: m" in err.value.message
    with pytest.raises(SessionError) as err:
        sessions.open_session(client_api_pb2.OpenSessionRequest(model="m", max_length=0))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    other = identity.generate_private_key()
    forged = identity.sign_capability(
        other,
        client_api_pb2.CapabilityClaims(
            session_id="s1", model="m", expires_unix_ms=int(time.time() * 1000) + 10_000
        ),
    )
    with pytest.raises(SessionError) as err:
        sessions.reroute(client_api_pb2.RerouteRequest(session_id="s1", capability=forged))
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_model_spec_counts_parameters_like_the_checkpoint():
    spec = model_spec("m", CONFIG)
    # q(64x64) k,v(32x64 each) o(64x64) + mlp 3x(64x128) + 2 norms
    assert spec.params_per_layer == 64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128 + 2 * 64
    assert spec.embed_params == 100 * 64 and spec.head_params == 64 + 100 * 64
    assert spec.kv_values_per_token_per_layer == 2 * 2 * 16


async def test_unavailable_models_say_why():
    swarm, placement, _, _ = make(min_stages=1)
    placement.node_up(PlacementNode("tiny", "127.0.0.1:1", caps(gb=0.0001)))
    await placement.replan()
    assert "do not have the memory" in placement.unavailable_reason("m")
    placement.node_up(PlacementNode("big", "127.0.0.1:2", caps(gb=4)))
    await placement.replan()
    assert placement.unavailable_reason("m") == "nodes are still fetching or loading layers 0-5"
    await ready_all(placement, swarm)
    assert placement.unavailable_reason("m") == ""


async def test_measured_speed_replaces_a_lying_benchmark_and_routes_follow_pipelines():
    swarm, placement, sessions, key = make(min_stages=1)
    # Both nodes hold the whole model; "liar" claims 10x the matmul rate of "honest".
    placement.node_up(PlacementNode("liar", "127.0.0.1:9100", caps(tflops=10.0)))
    placement.node_up(PlacementNode("honest", "127.0.0.1:9101", caps(tflops=1.0)))
    await placement.replan()
    await ready_all(placement, swarm)
    spec = model_spec("m", CONFIG)
    before = {h.node_id: h for h in placement.ready_holders("m")}
    assert before["liar"].ms_per_layer < before["honest"].ms_per_layer  # the claim, for now
    assert all(h.group for h in before.values())  # each is a pipeline of its own
    # Drivers time real traffic: the liar is really 4x slower per layer than the honest one.
    honest_ms = before["honest"].ms_per_layer
    for node_id, ms in (("liar", 4 * honest_ms), ("honest", honest_ms)):
        placement.measurements.observe_step(
            node_id,
            layers=2,
            params_per_layer=spec.params_per_layer,
            tokens=1,
            compute_ms=2 * ms,
        )
    after = {h.node_id: h for h in placement.ready_holders("m")}
    assert after["liar"].ms_per_layer == pytest.approx(4 * honest_ms)  # one observation
    grant = sessions.open_session(client_api_pb2.OpenSessionRequest(model="m", max_length=32))
    assert [s.primary.node_id for s in grant.stages] == ["honest"]


async def test_the_latency_bound_reaches_the_planner_and_dissolves_slow_pipelines():
    """Two nodes of a fast pair and two of a 1,000x slower pair, each holding half the
    model: without a bound both pairs are pipelines; with a bound a quarter of the way from
    the fast pair's estimated time per token to the slow pair's (below any mixed pair too)
    only the fast pair is a pipeline and the slow pair replicates layers."""
    cards = {"f0": caps(0.0025, 1.0), "f1": caps(0.0025, 1.0)}
    cards |= {"s0": caps(0.0025, 0.001), "s1": caps(0.0025, 0.001)}
    spec = model_spec("m", CONFIG)

    async def planned(bound_s: float):
        swarm = Swarm()
        placement = Placement(
            swarm.send, replicas=1, min_stages=1, debounce_s=0, max_token_latency_s=bound_s
        )
        placement.set_models([spec])
        for node_id, card in cards.items():
            placement.node_up(PlacementNode(node_id, "127.0.0.1:1", card))
        await placement.replan()
        return placement.plan_of("m")

    free = await planned(0.0)
    assert sorted(sorted(p) for p in free.pipelines) == [["f0", "f1"], ["s0", "s1"]]
    specs = {nid: node_spec(PlacementNode(nid, "", card), 2048) for nid, card in cards.items()}
    fast, slow = sorted(pipeline_seconds(spec, free, specs, p) for p in free.pipelines)
    assert slow > fast
    # Below the mixed pairs (fast + slow halves: the mean of the two) too.
    p = await planned(fast + (slow - fast) / 4)
    assert [sorted(pipe) for pipe in p.pipelines] == [["f0", "f1"]]
    assert set(p.holders) == set(cards) and not p.missing_layers()


async def test_prices_reach_the_planner_and_the_price_bound_dissolves_dear_pipelines():
    """Four equal nodes that each hold half the model, two of them asking 10x the others'
    price: without a price bound both pairs are pipelines; with a bound between the cheap
    pair's price per 1,000 tokens and any pair with a dear node, only the cheap pair is a
    pipeline, and the dear nodes replicate layers."""
    spec = model_spec("m", CONFIG)
    prices = {"c0": 1.0, "c1": 1.0, "d0": 10.0, "d1": 10.0}
    bound = spec.num_layers * 2.0  # the cheap pair costs L x 1; a dear member, > L x 5

    async def planned(max_token_price: float) -> ModelPlan:
        swarm = Swarm()
        placement = Placement(swarm.send, replicas=1, debounce_s=0, max_token_price=max_token_price)
        placement.price_of = prices.__getitem__
        placement.set_models([spec])
        for node_id in prices:
            placement.node_up(PlacementNode(node_id, "127.0.0.1:1", caps(0.0025)))
        await placement.replan()
        return placement.plan_of("m")

    assert len((await planned(0.0)).pipelines) == 2
    p = await planned(bound)
    assert [sorted(pipe) for pipe in p.pipelines] == [["c0", "c1"]]
    assert set(p.holders) == set(prices) and not p.missing_layers()


async def test_a_node_joining_while_a_replan_sends_assignments_is_planned_too():
    """The re-plan that is busy sending took its snapshot before the node came: another
    pass must follow, or the node would idle until some later change (a lost wake-up)."""
    swarm = Swarm()
    sending = asyncio.Event()
    release = asyncio.Event()

    async def slow_send(node_id: str, command) -> bool:
        sending.set()
        await release.wait()
        return await swarm.send(node_id, command)

    placement = Placement(slow_send, replicas=2, min_stages=1, debounce_s=0.01)
    placement.set_models([model_spec("m", CONFIG)])
    placement.node_up(PlacementNode("n0", "127.0.0.1:9000", caps()))
    await asyncio.wait_for(sending.wait(), 5)
    placement.node_up(PlacementNode("n1", "127.0.0.1:9001", caps()))
    release.set()
    await asyncio.wait_for(placement.settled(), 5)
    assert {c[0] for c in swarm.commands if c[1] == "assign"} == {"n0", "n1"}


async def test_a_shard_assigned_again_to_the_node_serving_it_stays_routable():
    # A restarted coordinator hears from each node which shards it serves, then plans and
    # assigns them those same shards. Until a node confirms, sessions must still find its
    # shard: a hole there refused sessions for a moment after every restart.
    first, placement, _, _ = make()
    for i in range(3):
        placement.node_up(PlacementNode(f"n{i}", f"127.0.0.1:{9000 + i}", caps()))
    await placement.replan()
    served = [(n, s, e) for n, kind, s, e in first.commands if kind == "assign"]

    swarm, restarted, sessions, _ = make()
    for i in range(3):
        restarted.node_up(PlacementNode(f"n{i}", f"127.0.0.1:{9000 + i}", caps()))
    for node_id, start, end in served:
        await restarted.shard_status(
            node_id,
            node_pb2.ShardStatus(model="m", layers=common_pb2.LayerRange(start=start, end=end),
                                 state=node_pb2.SHARD_STATE_READY),
        )  # fmt: skip
    assert restarted.coverage("m") == [2] * 6
    await restarted.replan()
    again = [(n, s, e) for n, kind, s, e in swarm.commands if kind == "assign"]
    assert again and set(again) <= set(served), "the plan assigns what the nodes serve"
    assert restarted.coverage("m") == [2] * 6
    grant = sessions.open_session(client_api_pb2.OpenSessionRequest(model="m", max_length=32))
    assert grant.stages
