"""Petals-greedy behaves as described in ANCHORS.md on cases small enough to check by hand."""

import numpy as np
from placement_sim.petals_greedy import PetalsSystem, choose_window, petals_route
from placement_toy import FAR, HOME, gpu_holding, node, swarm, toy_model


def test_the_window_with_the_weakest_sorted_throughputs_wins():
    totals = np.array([5.0, 1.0, 1.0, 5.0, 0.5, 9.0])
    # sorted windows of 2: [1,5] [1,1] [1,5] [0.5,5] [0.5,9] -> [0.5,5] is least
    assert choose_window(totals, 2) == 3
    # the weakest block ties, the second decides: [1,3] [1,2] [1,2] [1,3] -> first [1,2]
    assert choose_window(np.array([3.0, 1.0, 2.0, 1.0, 3.0]), 2) == 1
    assert choose_window(np.zeros(4), 4) == 0


def _state(spans: dict[str, tuple[int, int]], throughput: dict[str, float]) -> PetalsSystem:
    model = toy_model(4)
    gpu = gpu_holding(2.5)  # every server's span is 2 blocks
    system = PetalsSystem(swarm(*(node(n, gpu=gpu) for n in spans), model=model), seed=3)
    system.spans = dict(spans)
    system.throughput = dict(throughput)
    system.totals = np.zeros(4)
    for nid, (a, b) in spans.items():
        system.totals[a:b] += throughput[nid]
    return system


def test_a_server_moves_to_cover_an_empty_block():
    system = _state({"a": (0, 2), "b": (0, 2)}, {"a": 10, "b": 10})  # blocks 2-3 uncovered
    assert system.should_move("a")


def test_the_075_rule_moves_for_a_big_gain_only():
    # totals [16,16,2,2]; c moving to blocks 2-3 lifts the bottleneck 2 -> 8: 2/8 < 0.75
    big = _state({"a": (0, 2), "b": (2, 4), "c": (0, 2)}, {"a": 10, "b": 2, "c": 6})
    assert big.should_move("c")
    # totals [11,11,9,9]; c moving lifts it 9 -> 10: 9/10 >= 0.75, so it stays
    small = _state({"a": (0, 2), "b": (2, 4), "c": (0, 2)}, {"a": 10, "b": 9, "c": 1})
    assert not small.should_move("c")


def test_servers_joining_one_by_one_cover_the_weakest_blocks_first():
    model = toy_model(8)
    gpu = gpu_holding(4.5)
    nodes = [node(f"s{i}", gpu=gpu) for i in range(4)]
    system = PetalsSystem(swarm(*nodes, model=model), seed=1)
    system.start()
    spans = system.ranges()
    assert sorted(b - a for a, b in spans.values()) == [4, 4, 4, 4]
    coverage = np.zeros(8)
    for a, b in spans.values():
        coverage[a:b] += 1
    assert coverage.tolist() == [2.0] * 8, spans


def test_moving_reloads_the_whole_span():
    # a restart fetches every block of the new span, even ones it held before (#389)
    system = _state({"a": (0, 2), "b": (0, 2)}, {"a": 10, "b": 10})
    fetched = system._checks(float("inf"))
    assert system.moves == 1
    assert fetched == 2 * system.swarm.model.layer_bytes


def test_routing_prefers_the_near_server_and_avoids_a_full_one():
    model = toy_model(4)
    s = swarm(node("near", HOME), node("far", FAR), model=model)
    spans = {"near": (0, 4), "far": (0, 4)}
    hops = petals_route(s, spans, HOME, full=set())
    assert [(h.node_id, h.start, h.end) for h in hops] == [("near", 0, 4)]
    hops = petals_route(s, spans, HOME, full={"near"})  # 10 s penalty for a full cache
    assert [(h.node_id, h.start, h.end) for h in hops] == [("far", 0, 4)]


def test_routing_switches_servers_at_block_granularity():
    model = toy_model(4)
    s = swarm(node("a"), node("b"), model=model)
    hops = petals_route(s, {"a": (0, 3), "b": (2, 4)}, HOME, full=set())
    assert [(h.node_id, h.start, h.end) for h in hops] == [("a", 0, 3), ("b", 3, 4)]
    assert petals_route(s, {"a": (0, 2), "b": (3, 4)}, HOME, full=set()) is None  # gap
