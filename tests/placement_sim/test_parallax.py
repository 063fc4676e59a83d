"""Parallax's DP, k^2/s*(k) choice, water-filling and routing on hand-checkable cases."""

from placement_sim.parallax import (
    ParallaxSystem,
    best_pipeline_count,
    parallax_route,
    pipelines_for,
    stage_counts,
    water_fill,
)
from placement_toy import FAR, HOME, gpu_holding, node, swarm, toy_model

INF = 2**31 // 2 - 1  # stage_counts' 'impossible'


def test_fewest_stages_for_k_pipelines_and_the_k_squared_choice():
    caps = [10, 5, 5, 2, 2, 2, 2, 2]  # sorted, need 10 layers per pipeline
    counts = stage_counts(caps, 10).tolist()
    assert counts == [0, 1, 3, 8]  # [10] | [10] + [5,5] | + [2,2,2,2,2]
    # k^2/s*: 1/1 = 1, 4/3 = 1.33, 9/8 = 1.125 -> two pipelines, the 2 GB cards stay out
    assert best_pipeline_count(stage_counts(caps, 10)) == 2
    assert pipelines_for(caps, 10, 2) == [[0], [1, 2]]


def test_more_pipelines_win_when_they_cost_no_extra_stages_per_pipeline():
    caps = [9, 9, 5, 5, 1, 1]
    # capacity sums to 3 pipelines, but runs of similar cards make only 2: [9,9] and [5,5]
    assert stage_counts(caps, 10).tolist() == [0, 2, 4, INF]
    assert best_pipeline_count(stage_counts(caps, 10)) == 2
    assert stage_counts([3, 3], 10).tolist() == [0]
    assert best_pipeline_count(stage_counts([3, 3], 10)) == 0


def test_water_filling_is_proportional_within_capacity():
    assert water_fill(10, [1.0, 1.0, 2.0], [10, 10, 10]) == [3, 2, 5]  # 2.5 2.5 5
    assert water_fill(10, [1.0, 1.0, 8.0], [10, 10, 4]) == [3, 3, 4]  # capped at 4
    assert water_fill(10, [1.0, 1.0], [4, 4]) is None


def test_a_pipeline_splits_layers_by_speed():
    model = toy_model(8)
    # plain capacity 7 each: the pipeline needs 8 layers + embedding + head, so two nodes
    fast = node("fast", gpu=gpu_holding(7.5, memory_gbps=300.0))
    slow = node("slow", gpu=gpu_holding(7.5, memory_gbps=100.0))
    system = ParallaxSystem(swarm(fast, slow, model=model))
    system.start()
    # memory bound: speed 3:1 -> 6 and 2 layers; the fast node (first in order) leads
    assert system.ranges() == {"fast": (0, 6), "slow": (6, 8)}


def test_leftover_and_joining_nodes_take_the_least_covered_layers():
    model = toy_model(8)
    system = ParallaxSystem(swarm(node("x", gpu=gpu_holding(4.5)), model=model))
    assigned = {"a": (0, 6), "b": (6, 8), "c": (0, 4)}  # coverage 2 2 2 2 1 1 1 1
    assert system._least_covered_window("x", assigned) == (4, 8)


def test_routing_takes_the_cheapest_chain_and_may_enter_a_range_part_way():
    model = toy_model(4)
    s = swarm(node("a"), node("b"), node("far0", FAR), node("far1", FAR), model=model)
    assigned = {"a": (0, 3), "b": (2, 4), "far0": (0, 2), "far1": (2, 4)}
    hops = parallax_route(s, assigned, HOME, load={}, full=set())
    assert [(h.node_id, h.start, h.end) for h in hops] == [("a", 0, 3), ("b", 3, 4)]
    hops = parallax_route(s, assigned, HOME, load={}, full={"a"})
    assert [h.node_id for h in hops] == ["far0", "far1"]
    assert parallax_route(s, {"a": (0, 2)}, HOME, load={}, full=set()) is None
