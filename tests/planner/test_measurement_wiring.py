"""Measurement wiring: driver step reports and node RTT probes reach placement and routing.

ReportStepTimes (Sessions.report_step_times) feeds Placement.measurements.observe_step
for nodes the capability grants, refusing malformed, oversized and hostile reports; RTTs
reported in telemetry count only for peers the coordinator asked the node to probe; and
sessions route with the measured pair RTTs.
"""

from __future__ import annotations

import time

import grpc
import pytest
from planner.test_placement_and_sessions import ReplanCounter, caps, make, ready_all

from coordinator.placement import (
    MAX_PROBE_PEERS,
    PlacementNode,
    claimed_ms_per_gparam,
    node_spec,
)
from coordinator.sessions import MAX_STEP_TIMES, SessionError
from protos import identity
from protos.tessera.v1 import client_api_pb2, common_pb2, node_pb2


async def ready_session(max_length: int = 32, *, nodes: int = 3, min_stages: int = 3):
    """A session on `nodes` ready nodes (three stages by default)."""
    swarm, placement, sessions, key = make(min_stages)
    for i in range(nodes):
        placement.node_up(PlacementNode(f"n{i}", f"127.0.0.1:{9000 + i}", caps()))
    await placement.replan()
    await ready_all(placement, swarm)
    grant = sessions.open_session(
        client_api_pb2.OpenSessionRequest(model="m", max_length=max_length)
    )
    return swarm, placement, sessions, key, grant


def report(grant, steps) -> client_api_pb2.StepTimesReport:
    return client_api_pb2.StepTimesReport(
        session_id=grant.session_id, capability=grant.capability, steps=steps
    )


def step_of(stage: client_api_pb2.RouteStage, wall_ms: float = 5.0, tokens: int = 1):
    return client_api_pb2.StepTime(
        node_id=stage.primary.node_id, layers=stage.layers, tokens=tokens, wall_ms=wall_ms
    )


async def test_step_reports_replace_the_claimed_speed():
    _, placement, sessions, _, grant = await ready_session()
    stage = grant.stages[0]
    node = stage.primary.node_id
    claimed = placement.speed(node).claimed_ms_per_gparam
    before = {h.node_id: h.ms_per_layer for h in placement.ready_holders("m")}[node]
    ack = sessions.report_step_times(report(grant, [step_of(stage, 50.0)] * 8))
    assert ack.accepted == 8
    speed = placement.speed(node)
    assert speed.samples == 8 and speed.measured
    # 50 ms for 2 layers of the tiny model is far slower than the 1-TFLOPS claim.
    assert speed.ms_per_gparam > 100 * claimed
    after = {h.node_id: h.ms_per_layer for h in placement.ready_holders("m")}[node]
    assert after > 100 * before, "the router must see the measured speed"


async def test_bad_step_reports_are_refused_with_the_right_codes():
    _, placement, sessions, _, grant = await ready_session(max_length=4)
    stage = grant.stages[0]
    cases = [
        ([step_of(stage)] * (MAX_STEP_TIMES + 1), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (
            [
                client_api_pb2.StepTime(
                    node_id="stranger", layers=stage.layers, tokens=1, wall_ms=1.0
                )
            ],  # fmt: skip
            grpc.StatusCode.PERMISSION_DENIED,
        ),
        (
            [
                client_api_pb2.StepTime(
                    node_id=stage.primary.node_id,
                    tokens=1,
                    wall_ms=1.0,
                    layers=common_pb2.LayerRange(start=0, end=6),
                )
            ],  # fmt: skip
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ([step_of(stage, tokens=0)], grpc.StatusCode.INVALID_ARGUMENT),
        ([step_of(stage, tokens=5)], grpc.StatusCode.INVALID_ARGUMENT),  # over max_length
        ([step_of(stage, wall_ms=float("nan"))], grpc.StatusCode.INVALID_ARGUMENT),
        ([step_of(stage, wall_ms=-1.0)], grpc.StatusCode.INVALID_ARGUMENT),
        ([step_of(stage, wall_ms=float("inf"))], grpc.StatusCode.INVALID_ARGUMENT),
        ([step_of(stage, wall_ms=1e12)], grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for steps, code in cases:
        with pytest.raises(SessionError) as err:
            sessions.report_step_times(report(grant, steps))
        assert err.value.code == code, (steps[:1], err.value.message)
        assert err.value.message
    assert placement.speed(stage.primary.node_id).samples == 0, "a refused report counts nothing"
    # Another session's capability and a forged one.
    with pytest.raises(SessionError) as err:
        sessions.report_step_times(
            client_api_pb2.StepTimesReport(session_id="other", capability=grant.capability)
        )
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    forged = identity.sign_capability(
        identity.generate_private_key(),
        client_api_pb2.CapabilityClaims(
            session_id=grant.session_id, model="m", expires_unix_ms=int(time.time() * 1e3) + 9000
        ),
    )
    with pytest.raises(SessionError) as err:
        sessions.report_step_times(
            client_api_pb2.StepTimesReport(session_id=grant.session_id, capability=forged)
        )
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    # Unreachable nodes: only those the capability grants, at most one entry per node.
    granted = {g.node_id for g in client_api_pb2.CapabilityClaims.FromString(
        grant.capability.claims).grants}  # fmt: skip
    for ids, why in (
        (["stranger"], "does not grant"),
        ([stage.primary.node_id] * (len(granted) + 1), "unreachable nodes reported"),
    ):
        with pytest.raises(SessionError) as err:
            sessions.report_step_times(
                client_api_pb2.StepTimesReport(
                    session_id=grant.session_id,
                    capability=grant.capability,
                    unreachable_node_ids=ids,
                )
            )
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.message
    # A session reports each node at most max_length times: one client cannot drown a node.
    sessions.report_step_times(report(grant, [step_of(stage)] * 4))
    with pytest.raises(SessionError) as err:
        sessions.report_step_times(report(grant, [step_of(stage)]))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert placement.speed(stage.primary.node_id).samples == 4


async def test_nodes_are_told_their_neighbours_and_only_those_rtts_count():
    swarm, placement, _, _, grant = await ready_session()
    ids = {f"n{i}" for i in range(3)}
    for node_id in ids:
        peers = dict(swarm.probes[node_id])
        assert node_id not in peers and set(peers) <= ids and peers
        assert all(address.startswith("127.0.0.1:") for address in peers.values())
        assert len(peers) <= MAX_PROBE_PEERS
    a = grant.stages[0].primary.node_id
    b = next(p for p, _ in swarm.probes[a])
    kept = placement.observe_rtts(a, {b: 40.0, "stranger": 1.0, a: 0.0})
    assert kept == 1 and placement.rtt_ms(a, b) == pytest.approx(40.0)
    assert placement.rtt_ms(a, "stranger") == 0.0
    # Hostile values are dropped, not averaged in.
    assert placement.observe_rtts(a, {b: -5.0}) == 0
    assert placement.observe_rtts(a, {b: float("nan")}) == 0
    assert placement.observe_rtts(a, {b: 1e9}) == 0
    assert placement.rtt_ms(a, b) == pytest.approx(40.0)
    # A node that leaves is no longer asked about, and its list is resent when it returns.
    placement.node_down(b)
    await placement.replan()
    assert all(b not in dict(swarm.probes[n]) for n in ids - {b})


async def test_sessions_route_around_a_measured_slow_link():
    """Two full replicas of each stage; the link from the first stage to one replica of the
    second is measured slow, so the route takes the other replica."""
    swarm, placement, sessions, _ = make()
    for i in range(6):
        placement.node_up(PlacementNode(f"n{i}", f"127.0.0.1:{9000 + i}", caps()))
    await placement.replan()
    await ready_all(placement, swarm)
    grant = sessions.open_session(client_api_pb2.OpenSessionRequest(model="m", max_length=8))
    first, second = grant.stages[0].primary.node_id, grant.stages[1].primary.node_id
    others = [a.node_id for a in grant.stages[1].alternates]
    assert others, "the test needs an alternate for the second stage"
    placement.measurements.observe_rtts(first, {second: 500.0, **{o: 1.0 for o in others}})
    again = sessions.open_session(client_api_pb2.OpenSessionRequest(model="m", max_length=8))
    route = [stage.primary.node_id for stage in again.stages]
    # Whichever stage moved, no hand-off crosses the slow link any more.
    assert (first, second) not in zip(route, route[1:], strict=False), route


def test_the_claimed_speed_is_the_slower_of_compute_and_streaming_the_weights():
    def claimed(**fields) -> float:
        return claimed_ms_per_gparam(node_pb2.Capabilities(**fields))

    # An RTX 3090 in bf16: 71 TFLOP/s is 0.03 ms per billion parameters, but reading 2 GB
    # of weights at 936 GB/s takes 2.1 ms: decode at batch 1 is bound by the second.
    gpu = dict(device_kind="cuda", dtypes=["float32", "float16", "bfloat16"], matmul_tflops=71)
    assert claimed(**gpu, memory_bandwidth_gbps=936) == pytest.approx(2 / 936 * 1e3)
    # A CPU in fp32 reads 4 bytes a parameter.
    assert claimed(device_kind="cpu", matmul_tflops=1.0, memory_bandwidth_gbps=50) == (
        pytest.approx(4 / 50 * 1e3)
    )
    # Compute-bound when the bandwidth is plentiful, and an older agent that reports no
    # bandwidth keeps the matmul prior.
    assert claimed(device_kind="cpu", matmul_tflops=0.01, memory_bandwidth_gbps=50) == 200.0
    assert claimed(**gpu) == pytest.approx(2 / 71)


def test_the_planner_sees_the_nodes_bandwidth():
    node = PlacementNode("fast-gpu", "127.0.0.1:9100", caps())
    node.capabilities.memory_bandwidth_gbps = 900.0
    spec = node_spec(node, kv_tokens=4096)
    assert spec.mem_bandwidth == 900.0


async def test_a_calls_fixed_part_reaches_planning_routing_and_list_nodes():
    """A node's calls cost 3 ms whatever their layers, plus 2 ms a layer. Once drivers
    timed it on two spans, placement plans, routes and lists it with the fixed part told
    apart, and later calls on the smaller span alone are no change of speed to re-plan for."""
    _, placement, sessions, _, grant = await ready_session(256, nodes=2, min_stages=1)
    stage = grant.stages[0]
    node, span = stage.primary.node_id, stage.layers
    assert (span.start, span.end) == (0, 6)  # one node serves the whole tiny model
    one_layer = common_pb2.LayerRange(start=0, end=1)

    def timed(
        layers: common_pb2.LayerRange, count: int, slower: float = 1.0
    ) -> list[client_api_pb2.StepTime]:
        wall = slower * (3.0 + 2.0 * (layers.end - layers.start))
        step = client_api_pb2.StepTime(node_id=node, layers=layers, tokens=1, wall_ms=wall)
        return [step] * count

    assert sessions.report_step_times(report(grant, timed(span, 16))).accepted == 16
    assert placement.speed(node).call_ms == 0.0  # one span: not told apart yet
    assert sessions.report_step_times(report(grant, timed(one_layer, 16))).accepted == 16
    assert sessions.report_step_times(report(grant, timed(span, 32))).accepted == 32
    params = placement.measurements.work(node) * 1e9 / 6  # parameters per layer
    speed = placement.speed(node)
    assert speed.call_ms == pytest.approx(3.0, rel=1e-6)
    assert speed.ms_per_gparam * params / 1e9 == pytest.approx(2.0, rel=1e-2)
    holder = {h.node_id: h for h in placement.ready_holders("m")}[node]
    assert holder.call_ms == pytest.approx(3.0, rel=1e-6)
    assert holder.cost(6) == pytest.approx(15.0, rel=1e-2)
    spec = node_spec(PlacementNode(node, "x", caps()), 1024, placement.measurements)
    assert spec.call_ms == pytest.approx(3.0, rel=1e-6)

    await placement.settled()  # the re-plan the claim's correction asked for
    await placement.replan()  # the plan now assumes 3 ms + 2 ms a layer for the node
    replans = ReplanCounter(placement)
    # 5 ms for 1 layer is 2.5x its per-parameter time on 6 layers, and just what the plan
    # expects of a 1-layer call: no shift.
    assert sessions.report_step_times(report(grant, timed(one_layer, 64))).accepted == 64
    await placement.settled()
    assert replans.count == 0
    # The same node slowing down 3x on that span is still a shift, and re-plans.
    slow = timed(one_layer, 64, slower=3.0)
    assert sessions.report_step_times(report(grant, slow)).accepted == 64
    await placement.settled()
    assert replans.count == 1
