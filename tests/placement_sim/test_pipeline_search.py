"""The search behind the benchmark's 'best found' row: its plans are real, and it climbs."""

from itertools import combinations

import pytest
from placement_sim.evaluate import client_count
from placement_sim.pipeline_search import PipelineSearch, members_of, search
from placement_sim.regions import AccessLine, Site
from placement_sim.scenarios import FULL, quick
from placement_sim.swarm import ServingParams, Swarm
from placement_sim.tessera import TesseraSystem
from placement_toy import EXACT, HOME, gpu_holding, node, swarm, toy_model

SLOW_LINE = AccessLine("dsl", rtt_ms=5.0, up_mbps=0.5, down_mbps=8.0)
SLOW_HOME = Site("us-east", SLOW_LINE)


def _partitions(items):
    """Every way to split `items` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for size in range(len(rest) + 1):
        for others in combinations(rest, size):
            left = [x for x in rest if x not in others]
            for tail in _partitions(left):
                yield [[first, *others], *tail]


def _check_plan(s: Swarm, chains) -> None:
    model = s.model
    embed, head = model.embed_params * 2, model.head_params * 2
    seen: set[str] = set()
    for hops in chains:
        ids = [h.node_id for h in hops]
        assert not seen & set(ids), "a node in two pipelines"
        seen |= set(ids)
        assert hops[0].start == 0 and hops[-1].end == model.num_layers
        assert all(a.end == b.start for a, b in zip(hops, hops[1:], strict=False))
        for i, h in enumerate(hops):
            extra = (embed if i == 0 else 0) + (head if i == len(hops) - 1 else 0)
            assert 1 <= h.layers <= s.capacity(h.node_id, extra), h


@pytest.mark.parametrize("name", ["13b-atlantic-steam", "70b-global-steam"])
def test_the_search_keeps_whole_pipelines_within_memory_and_never_loses_value(name):
    scenario = quick([s for s in FULL if s.name == name])[0]
    s = Swarm.of(scenario.model, ServingParams(), scenario.build_nodes())
    clients = scenario.clients(client_count(s))
    tessera = TesseraSystem(s, replicas=2)
    tessera.start()
    assert tessera.plan is not None
    start = sum(PipelineSearch(s, clients).value(p) or 0.0 for p in tessera.plan.pipelines)
    chains, value = search(s, clients, tessera.plan.pipelines)
    _check_plan(s, chains)
    assert value >= start > 0
    state = PipelineSearch(s, clients)
    assert value == pytest.approx(sum(state.value([h.node_id for h in c]) for c in chains))


def test_the_search_finds_the_best_plan_of_a_small_swarm():
    # Six nodes that hold 2 of 4 layers each, anywhere: pipelines of two or more. Fast and
    # slow memory, fibre and a slow uplink; the start pairs each fast card with a slow one.
    model = toy_model(4)
    fast, slow = gpu_holding(2.5, 400.0, "fast"), gpu_holding(2.5, 50.0, "slow")
    nodes = [
        node("f1", HOME, fast),
        node("f2", HOME, fast),
        node("f3", SLOW_HOME, fast),
        node("s1", HOME, slow),
        node("s2", HOME, slow),
        node("s3", SLOW_HOME, slow),
    ]
    s = swarm(*nodes, model=model, params=EXACT)
    assert all(m.mid == 2 and m.both == 2 for m in members_of(s).values())
    clients = [HOME]
    state = PipelineSearch(s, clients)
    best = max(
        sum(state.value(group) or 0.0 for group in plan)
        for plan in _partitions([n.node_id for n in nodes])
    )
    start = [["f1", "s1"], ["f2", "s2"], ["f3", "s3"]]
    assert sum(state.value(p) for p in start) < best * 0.99  # the start is not the best
    chains, value = search(s, clients, start)
    _check_plan(s, chains)
    assert value == pytest.approx(best)


def test_a_pipeline_ends_on_its_slowest_uploader():
    # The last member hands nothing on: a slow uplink costs nothing there. (Every member
    # loses as little to the LM head, so only the uplink can pick "d".)
    model = toy_model(8)
    card = gpu_holding(2.5)
    s = swarm(*(node(n, HOME, card) for n in "abc"), node("d", SLOW_HOME, card), model=model)
    found = PipelineSearch(s, [HOME]).chain(["a", "b", "c", "d"])
    assert found is not None
    assert [h.node_id for h in found[1]][-1] == "d"


def test_nodes_that_cannot_cover_the_model_are_not_a_pipeline():
    model = toy_model(6)
    card = gpu_holding(2.5)
    s = swarm(node("a", HOME, card), node("b", HOME, card), model=model)
    assert PipelineSearch(s, [HOME]).value(["a", "b"]) is None
