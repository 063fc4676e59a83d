"""Several models share one swarm: every model that fits is served, memory follows demand,
and re-plans keep nodes with the model they serve unless demand has moved.

Placing models one after the other let the first model's pipelines take every node, and
the second was unavailable on a swarm that could serve both (the first test).
"""

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from planner.test_placement_and_sessions import CONFIG, ReplanCounter, Swarm, caps
from planner.test_planner_v2 import MODEL, node

from coordinator.placement import (
    DEMAND_HALF_LIFE_S,
    SPEED_SHIFT_HOLD,
    Placement,
    PlacementNode,
    model_spec,
)
from coordinator.planner import plan, shares

OTHER = replace(MODEL, name="other")


def pipelines(plans) -> dict[str, int]:
    return {name: len(p.pipelines) for name, p in plans.items()}


def test_a_second_model_is_served_too():
    nodes = [node(i, 0.1) for i in range(8)]  # each holds a bit over half a model
    plans = plan([MODEL, OTHER], nodes, replicas=1)
    assert pipelines(plans) == {"m": 2, "other": 2}
    assert not plans["m"].missing_layers() and not plans["other"].missing_layers()
    assert not set(plans["m"].holders) & set(plans["other"].holders)  # one model a node


def test_memory_follows_demand_and_every_model_keeps_a_floor():
    nodes = [node(i, 0.1) for i in range(16)]
    plans = plan([MODEL, replace(OTHER, demand=30.0)], nodes, replicas=1)
    assert pipelines(plans) == {"m": 2, "other": 6}
    plans = plan([replace(MODEL, demand=1000.0), OTHER], nodes, replicas=1)
    assert plans["other"].pipelines and not plans["other"].missing_layers()
    assert len(plans["m"].pipelines) > 4 * len(plans["other"].pipelines) / 2


def test_one_model_gets_every_node_and_none_is_no_error():
    nodes = [node(i, 0.1) for i in range(5)]
    assert shares([MODEL], nodes, {}) == ({"m": nodes}, {})
    # Nodes join before any model is imported: the re-plan they cause has nothing to place.
    assert plan([], nodes) == {}


def test_a_model_added_later_takes_whole_pipelines_and_the_rest_stay_put():
    nodes = [node(i, 0.1) for i in range(8)]
    alone = plan([MODEL], nodes, replicas=1)["m"]
    assert len(alone.pipelines) == 4
    plans = plan([MODEL, OTHER], nodes, {"m": alone}, replicas=1)
    assert pipelines(plans) == {"m": 2, "other": 2}
    assert set(plans["m"].pipelines) <= set(alone.pipelines)  # kept whole, not reshuffled
    for nid in plans["m"].holders:
        assert plans["m"].holders[nid] == alone.holders[nid]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.floats(0.06, 0.3), min_size=2, max_size=14),
    st.floats(0.0, 50.0),
    st.floats(0.0, 50.0),
)
def test_nothing_moves_when_nothing_changed_and_a_small_shift_in_demand_moves_no_node(
    sizes, demand_a, demand_b
):
    nodes = [node(i, gb) for i, gb in enumerate(sizes)]
    models = [replace(MODEL, demand=demand_a), replace(OTHER, demand=demand_b)]
    first = plan(models, nodes, replicas=1)
    again = plan(models, nodes, first, replicas=1)
    assert {m: p.holders for m, p in again.items()} == {m: p.holders for m, p in first.items()}
    # A tenth more demand for one model is within the hysteresis: no node changes model.
    nudged = [replace(models[0], demand=demand_a * 1.1), models[1]]
    moved = plan(nudged, nodes, first, replicas=1)
    for name in ("m", "other"):
        assert set(moved[name].holders) == set(first[name].holders)


async def test_placement_counts_sessions_and_replans_when_demand_shifts():
    swarm = Swarm()
    placement = Placement(swarm.send, replicas=1, debounce_s=0)
    placement.set_models([model_spec("a", CONFIG), model_spec("b", CONFIG)])
    for i in range(12):  # each node holds half a model: three pipelines a model
        placement.node_up(PlacementNode(f"n{i:02d}", "127.0.0.1:1", caps(0.0025)))
    await placement.settled()  # the re-plan the joins asked for
    assert len(placement.plan_of("a").pipelines) == len(placement.plan_of("b").pipelines) == 3
    assert placement.demand_shares() == {"a": 0.5, "b": 0.5}
    for _ in range(20):  # clients ask for "a" only
        placement.note_session("a")
    placement.note_session("ghost")  # not a model here: nothing counted
    await placement.settled()  # the shift caused a re-plan on its own
    assert len(placement.plan_of("a").pipelines) > len(placement.plan_of("b").pipelines) >= 1
    # Demand fades: each session counts half after a half-life.
    now = 1_000.0
    fading = Placement(swarm.send, replicas=1, debounce_s=0)
    fading.set_models([model_spec("a", CONFIG)])
    fading.note_session("a", now_s=now)
    fading.note_session("a", now_s=now)
    assert fading.demand("a", now_s=now + DEMAND_HALF_LIFE_S) == 1.0
    assert fading.demand("ghost", now_s=now) == 0.0


async def test_a_node_that_slows_down_causes_a_replan_and_a_spare_takes_its_place():
    """Overload: five nodes that each hold half the model make two pipelines and a spare.
    When drivers' step times show one member taking half a second a call (its owner's game
    took the GPU), placement re-plans on its own, and the spare serves in its place."""
    swarm = Swarm()
    placement = Placement(swarm.send, replicas=1, debounce_s=0)
    spec = model_spec("m", CONFIG)
    placement.set_models([spec])
    for i in range(5):
        placement.node_up(PlacementNode(f"n{i}", "127.0.0.1:1", caps(0.0025)))
    await placement.settled()
    before = placement.plan_of("m")
    members = {nid for pipe in before.pipelines for nid in pipe}
    assert len(before.pipelines) == 2 and len(members) == 4
    slow = sorted(members)[0]
    layers = before.holders[slow].layers
    for _ in range(SPEED_SHIFT_HOLD - 1):  # half a second a call, not for long enough yet
        placement.observe_step(slow, "m", layers, 1, 500.0)
    await placement.settled()
    assert placement.plan_of("m") is before
    placement.observe_step(slow, "m", layers, 1, 500.0)
    await placement.settled()
    after = placement.plan_of("m")
    assert len(after.pipelines) == 2
    assert slow not in {nid for pipe in after.pipelines for nid in pipe}, after.pipelines


async def test_a_node_whose_reports_swing_back_and_forth_causes_no_replan():
    """A busy node's step times swing from one report of 16 calls to the next (the
    average follows each report): a re-plan needs the shift to last, or every noisy report
    would re-plan and the next one re-plan back."""
    swarm = Swarm()
    placement = Placement(swarm.send, replicas=1, debounce_s=0)
    placement.set_models([model_spec("m", CONFIG)])
    for i in range(5):
        placement.node_up(PlacementNode(f"n{i}", "127.0.0.1:1", caps(0.0025)))
    await placement.settled()
    node = sorted(placement.plan_of("m").holders)[0]
    layers = placement.plan_of("m").holders[node].layers
    call_ms = 10.0
    for _ in range(2 * SPEED_SHIFT_HOLD):  # steady: the plan now assumes what was measured
        placement.observe_step(node, "m", layers, 1, call_ms)
    await placement.settled()
    steady = placement.plan_of("m")
    replans = ReplanCounter(placement)
    for _ in range(10):
        for ms in (4 * call_ms, call_ms / 4):  # a report's worth of each: 16 calls
            for _ in range(16):
                placement.observe_step(node, "m", layers, 1, ms)
            await placement.settled()
    assert replans.count == 0
    assert placement.plan_of("m") is steady
    for _ in range(2 * SPEED_SHIFT_HOLD):  # a shift that lasts still re-plans, once
        placement.observe_step(node, "m", layers, 1, 4 * call_ms)
    await placement.settled()
    assert replans.count == 1


async def test_nodes_joining_before_any_model_is_imported_replan_quietly(caplog):
    swarm = Swarm()
    placement = Placement(swarm.send, replicas=1, debounce_s=0)
    for i in range(3):
        placement.node_up(PlacementNode(f"n{i}", "127.0.0.1:1", caps(0.0025)))
    await placement.settled()
    assert "re-plan failed" not in caplog.text
    placement.set_models([model_spec("a", CONFIG)])
    await placement.settled()
    assert placement.plan_of("a").pipelines
