import pytest

from coordinator.router import Holder, NoRouteError, cover_span, route


def h(nid: str, start: int, end: int, ms: float = 1.0, load: float = 0.0) -> Holder:
    return Holder(nid, f"127.0.0.1:{1000 + len(nid)}", start, end, ms, load)


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
