import pytest

from coordinator.router import Holder, NoRouteError, cover_span, route


def h(
    nid: str, start: int, end: int, ms: float = 1.0, load: float = 0.0, group: str = ""
) -> Holder:
    return Holder(nid, f"127.0.0.1:{1000 + len(nid)}", start, end, ms, load, group)


def test_one_hop_per_stage_with_alternates_and_spread():
    holders = [h("a", 0, 8), h("b", 0, 12), h("c", 4, 12)]
    stages = route([0, 4, 8, 12], holders)
    assert [(s.start, s.end) for s in stages] == [(0, 4), (4, 8), (8, 12)]
    primaries = [s.primary.node_id for s in stages]
    assert len(set(primaries)) == 3, "distinct nodes when possible"
    for s in stages:
        assert s.primary.node_id not in {a.node_id for a in s.alternates}


def test_load_and_speed_choose_the_primary():
    stages = route([0, 4], [h("slow", 0, 4, ms=5.0), h("busy", 0, 4, load=9.0), h("ok", 0, 4)])
    assert stages[0].primary.node_id == "ok"
    assert [a.node_id for a in stages[0].alternates] == ["slow", "busy"]


def test_missing_layers_are_named():
    with pytest.raises(NoRouteError, match="4-7"):
        route([0, 4, 8], [h("a", 0, 4)])


def test_cover_span_uses_fewest_hops_and_avoids_excluded():
    holders = [h("a", 0, 6), h("b", 6, 12), h("c", 2, 12), h("dead", 0, 12)]
    hops = cover_span(4, 12, holders, exclude={"dead"})
    assert [(x.node_id, x.start, x.end) for x in hops] == [("c", 4, 12)]
    hops = cover_span(0, 12, holders, exclude={"dead", "c"})
    assert [(x.node_id, x.start, x.end) for x in hops] == [("a", 0, 6), ("b", 6, 12)]
    with pytest.raises(NoRouteError):
        cover_span(0, 12, [h("a", 0, 6)])


def test_a_whole_pipeline_is_preferred_over_borrowing_members_of_two():
    # p1 = a [0,6) + b [6,12), p2 = c [0,8) + d [8,12). The mixed chain c [0,8) + b [8,12)
    # is a little cheaper, but it would strand a and d: at saturation that loses sessions.
    holders = [
        h("a", 0, 6, ms=1.0, group="p1"),
        h("b", 6, 12, ms=0.9, group="p1"),
        h("c", 0, 8, ms=0.95, group="p2"),
        h("d", 8, 12, ms=1.0, group="p2"),
    ]
    stages = route([0, 12], holders)
    assert {s.primary.node_id for s in stages} in ({"a", "b"}, {"c", "d"})
    # Without pipeline labels the router takes the cheapest mix.
    plain = [Holder(x.node_id, x.address, x.start, x.end, x.ms_per_layer) for x in holders]
    assert [s.primary.node_id for s in route([0, 12], plain)] == ["c", "b"]
    # A pipeline with a member excluded (full or failed) is not whole: the route mixes.
    stages = route([0, 12], holders, exclude={"a", "d"})
    assert [s.primary.node_id for s in stages] == ["c", "b"]


def test_a_much_faster_mix_beats_a_whole_pipeline():
    holders = [
        h("a", 0, 6, ms=10.0, group="p1"),
        h("b", 6, 12, ms=10.0, group="p1"),
        h("fast", 0, 12, ms=1.0),
    ]
    assert [s.primary.node_id for s in route([0, 12], holders)] == ["fast"]


def test_a_calls_fixed_part_is_paid_once_per_hop():
    """Two nodes slightly faster per layer win a span only while a call costs nothing
    beyond its layers; with a fixed part per call, one node for the whole span wins."""
    faster_pair = [h("b", 0, 4, ms=0.8), h("c", 4, 8, ms=0.8)]
    plain = route([0, 8], [h("a", 0, 8, ms=1.0), *faster_pair])
    assert [s.primary.node_id for s in plain] == ["b", "c"]  # 6.4 ms < 8 ms
    with_calls = [
        Holder(x.node_id, x.address, x.start, x.end, x.ms_per_layer, call_ms=2.0)
        for x in [h("a", 0, 8, ms=1.0), *faster_pair]
    ]
    stages = route([0, 8], with_calls)  # 2 + 8 = 10 ms < 2 x (2 + 3.2) = 10.4 ms
    assert [(s.primary.node_id, s.start, s.end) for s in stages] == [("a", 0, 8)]
    assert with_calls[0].cost(8) == pytest.approx(10.0)
    loaded = Holder("a", "x", 0, 8, 1.0, load=1.0, call_ms=2.0)
    assert loaded.cost(8) == pytest.approx(20.0), "load slows the whole call"
