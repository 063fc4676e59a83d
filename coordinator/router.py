"""Router v1: the path a session takes through the ready replicas of a model.

Pure functions. A route has one hop per stage of the planner's layout, so pipelines stay
as deep as the operator asked; each stage gets the cheapest ready holder (load-adjusted
compute time) as primary, preferring nodes not already used by the route, and the other
ready holders as alternates for fail-over. Reroutes cover a failed span with the fewest
hops through any ready holders, even when their ranges do not line up with the layout.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Holder:
    node_id: str
    address: str
    start: int
    end: int
    ms_per_layer: float  # compute time of one layer for one token
    load: float = 0.0  # active sessions or queue length; raises the cost

    def cost(self, layers: int) -> float:
        return layers * self.ms_per_layer * (1.0 + self.load)


@dataclass(frozen=True)
class Hop:
    node_id: str
    address: str
    start: int
    end: int


@dataclass(frozen=True)
class Stage:
    start: int
    end: int
    primary: Hop
    alternates: tuple[Hop, ...]


class NoRouteError(Exception):
    """No ready replica covers some layers; the message names them."""


def route(
    boundaries: Sequence[int], holders: Sequence[Holder], exclude: Collection[str] = ()
) -> list[Stage]:
    stages: list[Stage] = []
    used: set[str] = set()
    missing: list[str] = []
    for a, b in zip(boundaries, boundaries[1:], strict=False):
        able = [h for h in holders if h.start <= a and b <= h.end and h.node_id not in exclude]
        if not able:
            missing.append(f"{a}-{b - 1}")
            continue
        able.sort(key=lambda h: (h.node_id in used, h.cost(b - a), h.node_id))
        hops = [Hop(h.node_id, h.address, a, b) for h in able]
        used.add(hops[0].node_id)
        stages.append(Stage(a, b, hops[0], tuple(hops[1:])))
    if missing:
        raise NoRouteError(f"no ready node serves layers {', '.join(missing)}")
    return stages


def cover_span(
    start: int, end: int, holders: Sequence[Holder], exclude: Collection[str] = ()
) -> list[Hop]:
    """Fewest hops (then lowest cost) covering [start, end) exactly, avoiding `exclude`."""
    usable = [h for h in holders if h.node_id not in exclude and h.start < end and h.end > start]
    # best[p] = (hops, cost, path) to reach layer boundary p from start
    best: dict[int, tuple[int, float, list[Hop]]] = {start: (0, 0.0, [])}
    for p in range(start, end):
        if p not in best:
            continue
        hops, cost, path = best[p]
        for h in usable:
            if h.start <= p < h.end:
                q = min(h.end, end)
                cand = (hops + 1, cost + h.cost(q - p), [*path, Hop(h.node_id, h.address, p, q)])
                if q not in best or cand[:2] < best[q][:2]:
                    best[q] = cand
    if end not in best:
        reached = max(best)
        raise NoRouteError(f"no ready node serves layers {reached}-{end - 1}")
    return best[end][2]
