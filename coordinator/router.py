"""Router v2: the path a session takes through the ready replicas of a model.

Pure functions. `boundaries` are the cuts every route must hop at: [0, L] for a pipeline
plan (the route is then the minimum-latency chain over all ready holders), the stage
layout when the operator asked for deeper pipelines (one or more hops per stage).

Within each stage a dynamic program over layer positions finds the cheapest chain of
holders: node cost is the load-adjusted time of a holder's call (its fixed part and the
layers it runs), edge cost is half the measured RTT between consecutive nodes (one way),
plus half the client's RTT at both ends. Every hop comes with alternates (other ready
holders of the same range, cheapest first) for fail-over. Nodes already used by the route
are avoided when another will do.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

# A hop on a node the route already uses costs this much more (ms): distinct nodes spread
# load and keep a pipeline as deep as the layout asks.
REUSE_PENALTY_MS = 1e6
# A whole pipeline is taken over the cheapest mixed chain unless the mix is faster by more
# than this fraction (see Holder.group).
GROUP_SLACK = 0.25
# Labels kept per layer position: more finds better chains when RTTs differ, at more cost.
BEAM = 3
MAX_ALTERNATES = 8

RttMs = Callable[[str, str], float]
ClientRttMs = Callable[[str], float]


@dataclass(frozen=True)
class Holder:
    node_id: str
    address: str
    start: int
    end: int
    ms_per_layer: float  # compute time of one layer for one token
    load: float = 0.0  # active sessions or queue length; raises the cost
    # The planner's pipeline this holder belongs to ("" for a spare replica). Whole
    # pipelines are preferred: a route that borrows one member of a pipeline strands the
    # others' KV slots, and at saturation that costs a whole session per borrowed slot.
    group: str = ""
    # Fixed time of a call whatever its layers: splitting a span over more hops pays it
    # once per hop, so a chain of nodes slightly faster per layer can lose to one node.
    call_ms: float = 0.0

    def cost(self, layers: int) -> float:
        return (self.call_ms + layers * self.ms_per_layer) * (1.0 + self.load)


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
    boundaries: Sequence[int],
    holders: Sequence[Holder],
    exclude: Collection[str] = (),
    *,
    rtt_ms: RttMs | None = None,
    client_rtt_ms: ClientRttMs | None = None,
) -> list[Stage]:
    """The minimum-latency route hopping at every cut of `boundaries`, with alternates.

    `rtt_ms(a, b)`: measured round trip between two nodes; `client_rtt_ms(n)`: between the
    client and node n. Both default to 0 (then compute and load alone decide).
    """
    usable = [h for h in holders if h.node_id not in exclude]
    cuts = list(boundaries)
    if len(cuts) == 2:
        whole = _best_group_chain(cuts[0], cuts[1], usable, holders, rtt_ms, client_rtt_ms)
        if whole is not None:
            mixed = _cheapest_chain(
                cuts[0], cuts[1], usable, set(), None, rtt_ms, client_rtt_ms, client_rtt_ms
            )
            mixed_cost = _chain_cost(mixed, rtt_ms, client_rtt_ms) if mixed else float("inf")
            if whole[0] <= mixed_cost * (1.0 + GROUP_SLACK):
                return _stages(whole[1], usable, rtt_ms)
    stages: list[Stage] = []
    used: set[str] = set()
    missing: list[str] = []
    previous: str | None = None
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        chain = _cheapest_chain(
            a,
            b,
            usable,
            used,
            previous,
            rtt_ms,
            client_rtt_ms if i == 0 else None,
            client_rtt_ms if i == len(cuts) - 2 else None,
        )
        if chain is None:
            missing.append(f"{a}-{b - 1}")
            continue
        for h, p, q in chain:
            stages.append(_stage(h, p, q, usable, previous, rtt_ms))
            used.add(h.node_id)
            previous = h.node_id
    if missing:
        raise NoRouteError(f"no ready node serves layers {', '.join(missing)}")
    return stages


def _stages(
    chain: Sequence[tuple[Holder, int, int]], usable: Sequence[Holder], rtt_ms: RttMs | None
) -> list[Stage]:
    stages: list[Stage] = []
    previous: str | None = None
    for h, p, q in chain:
        stages.append(_stage(h, p, q, usable, previous, rtt_ms))
        previous = h.node_id
    return stages


def _chain_cost(
    chain: Sequence[tuple[Holder, int, int]],
    rtt_ms: RttMs | None,
    client_rtt_ms: ClientRttMs | None,
) -> float:
    """What `_cheapest_chain` charges for a chain: load-adjusted compute, half RTTs."""
    cost = sum(h.cost(q - p) for h, p, q in chain)
    nodes = [h.node_id for h, _, _ in chain]
    cost += sum(_edge(rtt_ms, a, b) for a, b in zip(nodes, nodes[1:], strict=False))
    if client_rtt_ms is not None and chain:
        cost += (client_rtt_ms(chain[0][0].node_id) + client_rtt_ms(chain[-1][0].node_id)) / 2.0
    return cost


def _best_group_chain(
    start: int,
    end: int,
    usable: Sequence[Holder],
    holders: Sequence[Holder],
    rtt_ms: RttMs | None,
    client_rtt_ms: ClientRttMs | None,
) -> tuple[float, list[tuple[Holder, int, int]]] | None:
    """The cheapest pipeline whose members are all usable and chain exactly over
    [start, end), with its cost; None when there is none."""
    usable_ids = {h.node_id for h in usable}
    groups: dict[str, list[Holder]] = {}
    for h in holders:
        if h.group:
            groups.setdefault(h.group, []).append(h)
    best: tuple[float, list[tuple[Holder, int, int]]] | None = None
    for members in groups.values():
        if any(h.node_id not in usable_ids for h in members):
            continue
        members = sorted(members, key=lambda h: h.start)
        if (
            members[0].start != start
            or members[-1].end != end
            or any(x.end != y.start for x, y in zip(members, members[1:], strict=False))
        ):
            continue
        chain = [(h, h.start, h.end) for h in members]
        cost = _chain_cost(chain, rtt_ms, client_rtt_ms)
        if best is None or cost < best[0]:
            best = (cost, chain)
    return best


def _edge(rtt_ms: RttMs | None, a: str | None, b: str) -> float:
    if rtt_ms is None or a is None or a == b:
        return 0.0
    return rtt_ms(a, b) / 2.0


def _cheapest_chain(
    start: int,
    end: int,
    holders: Sequence[Holder],
    used: set[str],
    previous: str | None,
    rtt_ms: RttMs | None,
    client_in: ClientRttMs | None,
    client_out: ClientRttMs | None,
) -> list[tuple[Holder, int, int]] | None:
    """DP over layer positions in [start, end); a hop enters a holder anywhere in its range
    and leaves at the range's end (or at `end`). Keeps the BEAM cheapest labels per
    position, with distinct last nodes, because the next edge depends on the last node."""
    covering: dict[int, list[Holder]] = {}
    for h in holders:
        for p in range(max(h.start, start), min(h.end, end)):
            covering.setdefault(p, []).append(h)
    # label: (cost, last node id, path of (holder, p, q))
    labels: dict[int, list[tuple[float, str | None, tuple[tuple[Holder, int, int], ...]]]] = {
        start: [(0.0, previous, ())]
    }
    for p in range(start, end):
        here = labels.pop(p, None)
        if not here:
            continue
        for h in covering.get(p, ()):
            q = min(h.end, end)
            step = h.cost(q - p) + (REUSE_PENALTY_MS if h.node_id in used else 0.0)
            if p == start and client_in is not None:
                step += client_in(h.node_id) / 2.0
            if q == end and client_out is not None:
                step += client_out(h.node_id) / 2.0
            # A holder never appears twice in one chain: after it, p is past its range.
            best = min(here, key=lambda lab: lab[0] + _edge(rtt_ms, lab[1], h.node_id))
            cost = best[0] + _edge(rtt_ms, best[1], h.node_id) + step
            _push(labels.setdefault(q, []), (cost, h.node_id, (*best[2], (h, p, q))))
    final = labels.get(end)
    if not final:
        return None
    return list(min(final, key=lambda lab: lab[0])[2])


def _push(
    bucket: list[tuple[float, str | None, tuple[tuple[Holder, int, int], ...]]],
    label: tuple[float, str | None, tuple[tuple[Holder, int, int], ...]],
) -> None:
    for i, other in enumerate(bucket):
        if other[1] == label[1]:
            if label[0] < other[0]:
                bucket[i] = label
            return
    bucket.append(label)
    if len(bucket) > BEAM:
        bucket.sort(key=lambda lab: lab[0])
        del bucket[BEAM:]


def _stage(
    primary: Holder,
    p: int,
    q: int,
    holders: Sequence[Holder],
    previous: str | None,
    rtt_ms: RttMs | None,
) -> Stage:
    others = [h for h in holders if h.start <= p and q <= h.end and h.node_id != primary.node_id]
    others.sort(key=lambda h: (h.cost(q - p) + _edge(rtt_ms, previous, h.node_id), h.node_id))
    hops = tuple(Hop(h.node_id, h.address, p, q) for h in others[:MAX_ALTERNATES])
    return Stage(p, q, Hop(primary.node_id, primary.address, p, q), hops)


def cover_span(
    start: int,
    end: int,
    holders: Sequence[Holder],
    exclude: Collection[str] = (),
    *,
    rtt_ms: RttMs | None = None,
) -> list[Hop]:
    """Fewest hops (then lowest cost) covering [start, end) exactly, avoiding `exclude`."""
    usable = [h for h in holders if h.node_id not in exclude and h.start < end and h.end > start]
    # best[p] = (hops, cost, path) to reach layer boundary p from start
    best: dict[int, tuple[int, float, list[Hop]]] = {start: (0, 0.0, [])}
    for p in range(start, end):
        if p not in best:
            continue
        hops, cost, path = best[p]
        last = path[-1].node_id if path else None
        for h in usable:
            if h.start <= p < h.end:
                q = min(h.end, end)
                step = h.cost(q - p) + _edge(rtt_ms, last, h.node_id)
                cand = (hops + 1, cost + step, [*path, Hop(h.node_id, h.address, p, q)])
                if q not in best or cand[:2] < best[q][:2]:
                    best[q] = cand
    if end not in best:
        reached = max(best)
        raise NoRouteError(f"no ready node serves layers {reached}-{end - 1}")
    return best[end][2]
