"""Planner v2: pipelines use every card that can help, hysteresis, repairs, speed at scale."""

import math
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.planner import (
    ModelSpec,
    NodeSpec,
    estimated_tokens_per_s,
    plan,
)

MODEL = ModelSpec(
    "m",
    num_layers=24,
    params_per_layer=1_000_000,
    embed_params=4_000_000,
    head_params=4_000_000,
    kv_values_per_token_per_layer=512,
)


def node(i: int, gb: float, speed: float = 1.0, bw: float = 0.0, region: str = "") -> NodeSpec:
    return NodeSpec(
        f"n{i:02d}",
        usable_bytes=int(gb * 1e9),
        speed=speed,
        kv_tokens=1024,
        mem_bandwidth=bw,
        region=region,
    )


nodes_strategy = st.lists(
    st.tuples(st.floats(0.02, 0.3), st.floats(0.1, 50.0), st.sampled_from(["a", "b"])),
    min_size=1,
    max_size=12,
).map(lambda specs: [node(i, gb, speed, region=r) for i, (gb, speed, r) in enumerate(specs)])


def moved(before, after) -> bool:
    return any(
        nid in before.holders
        and not shard.covers(before.holders[nid].start, before.holders[nid].end)
        for nid, shard in after.holders.items()
    )


def test_small_cards_form_their_own_pipelines():
    # 0.06 GB holds 8 layers (6 next to the embedding or head): four make a pipeline.
    nodes = [node(0, 0.3)] + [node(i, 0.06) for i in range(1, 9)]
    p = plan([MODEL], nodes, replicas=1)["m"]
    assert len(p.pipelines) == 3
    assert len(p.holders) == 9


def test_fast_members_get_more_layers_and_regions_stay_together():
    nodes = [
        node(0, 0.15, bw=900, region="eu"),
        node(1, 0.15, bw=300, region="us"),
        node(2, 0.15, bw=300, region="eu"),
        node(3, 0.15, bw=900, region="us"),
    ]
    p = plan([MODEL], nodes, replicas=1)["m"]
    regions = {n.node_id: n.region for n in nodes}
    assert len(p.pipelines) == 2
    for pipe in p.pipelines:
        assert len({regions[nid] for nid in pipe}) == 1
        fast, slow = sorted(pipe, key=lambda nid: nid not in ("n00", "n03"))
        assert p.holders[fast].layers > p.holders[slow].layers


@settings(max_examples=100, deadline=None)
@given(nodes_strategy, nodes_strategy, st.data(), st.sampled_from([0.0, 0.2, 1.0, math.inf]))
def test_moves_only_when_the_gain_beats_the_hysteresis(nodes, joiners, data, hysteresis):
    first = plan([MODEL], nodes, replicas=1)["m"]
    joiners = [
        NodeSpec(f"j{i}", n.usable_bytes, n.speed, kv_tokens=n.kv_tokens, region=n.region)
        for i, n in enumerate(joiners)
    ]
    leaving = set(data.draw(st.lists(st.sampled_from([n.node_id for n in nodes]), max_size=3)))
    now = [n for n in nodes if n.node_id not in leaving] + joiners
    by_id = {n.node_id: n for n in now}
    second = plan([MODEL], now, {"m": first}, replicas=1, hysteresis=hysteresis)["m"]
    kept = plan([MODEL], now, {"m": first}, replicas=1, hysteresis=math.inf)["m"]
    fresh = plan([MODEL], now, replicas=1)["m"]
    if moved(first, kept):
        # Even with infinite hysteresis, a plan that cannot serve the model is replaced.
        assert kept.holders == fresh.holders == second.holders
        assert not fresh.missing_layers()
        return
    gain_beats = estimated_tokens_per_s(MODEL, fresh, by_id) > estimated_tokens_per_s(
        MODEL, kept, by_id
    ) * (1 + hysteresis)
    if gain_beats or (kept.missing_layers() and not fresh.missing_layers()):
        assert second.holders == fresh.holders
    else:
        assert second.holders == kept.holders
        assert not moved(first, second)


@settings(max_examples=100, deadline=None)
@given(nodes_strategy)
def test_an_idle_spare_repairs_a_broken_pipeline_without_other_moves(nodes):
    spare = node(99, 0.3, region="a")
    first = plan([MODEL], nodes, replicas=1)["m"]
    if not first.pipelines:
        return
    gone = first.pipelines[0][0]
    now = [n for n in nodes if n.node_id != gone] + [spare]
    second = plan([MODEL], now, {"m": first}, replicas=1, hysteresis=math.inf)["m"]
    assert not second.missing_layers()
    assert not moved(first, second)
    assert len(second.pipelines) >= len(first.pipelines)


def test_plan_takes_under_a_second_for_ten_thousand_nodes():
    # CPU time of this process: other work on a shared box must not make it flaky.
    big = ModelSpec("big", 80, 856_000_000, 262_000_000, 262_000_000, 2048)
    sizes = [8, 10, 12, 12, 16, 24]
    nodes = [
        NodeSpec(
            f"g{i:05d}",
            int(sizes[i % 6] * 0.9 * 2**30),
            speed=20.0 + i % 7,
            dtype_bytes=2,
            kv_tokens=2048,
            mem_bandwidth=300.0 + 100 * (i % 5),
            region=f"r{i % 5}",
        )
        for i in range(10_000)
    ]
    started = time.process_time()
    first = plan([big], nodes)["big"]
    elapsed = time.process_time() - started
    assert len(first.pipelines) > 100
    assert elapsed < 1.0, f"{elapsed:.2f} s"
    started = time.process_time()
    plan([big], nodes[1:], {"big": first})
    assert time.process_time() - started < 2.0
