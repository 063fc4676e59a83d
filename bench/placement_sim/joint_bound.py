"""Way (e) of the upper bound: one linear program that prices every session's parts together.

Ways (a)-(d) in `upper_bound.py` bound each part of a session's time on its own (the k
cheapest client legs, the k x L cheapest layer items, the cheapest hops) and add the sorted
parts term by term. That lets the first sessions take the fastest cards, the best uplinks
and the nearest clients at once, even where those sit in different regions and different
homes. Here one LP gives B(k), a lower bound on the total time per token of any k sessions,
with the parts tied to the same nodes and regions:

  - A session belongs to the class R of the regions it touches, and visits each of them.
    Its client c pays RTT(c, first) / 2 + RTT(c, last) / 2: c's own access line, half the
    backbone from c's region to the region where the session begins and to the one where
    it ends, and half the access lines of its first and last nodes.
  - A hop n -> m costs RTT(n, m) / 2, in three parts that are never negative: nearest_n / 2
    (with n's hand-off, below); entering[m], the least any hop into m pays beyond its
    sender's nearest half (mostly m's own access line), charged on every visit to m but a
    session's first; and crossing[a, b], what a hop between regions a and b pays on top.
    A session's crossings connect R, so they cost at least a lightest spanning tree of R.
    A session that begins and ends on the same node n, which cannot hold it alone, left n
    and came back: it pays one more hop out of n and one more entry into n.
  - Layer items (step 1 of upper_bound.py) come from nodes of R only: a class's sessions
    take at most cap_n items from n per visit, v[n, R] visits, at most `slots` visits to n
    in all and at most one per session (v[n, R] counts the sessions that pass n; one that
    came back would count once, its extra hop uncharged); a node serving b sessions runs
    every item at t_n(b), its whole batch's layer time (step 1 charges a session only
    t_n(j) for its place j in the batch).
  - Visits come whole: a session's visits hold >= L layers between them, so for any grain
    g their capacities in grains, rounded up, add up to >= ceil(L / g). Without that a
    session could make 6.67 visits of 12 layers for 80, where it makes 7, and so hop less
    and leave slots for more sessions. Where they are few enough (`_covers`), the LP also
    picks for each session a minimal cover (its end, with the head or not, and the
    capacities of its other visits; at 70B, 5 x 12 + 11 next to the head + 8 is 79, so a
    session that uses an 8-layer card makes 8 visits), and the class visits each kind of
    node at least as often as its sessions' covers say.
  - A node n serving b sessions, d of which end there, sends the b - d others on, each at
    least nearest_n / 2 + a hand-off of the whole batch, b x u_n (u_n: one session's). The
    LP holds each node as a mix of whole states (b sessions that all leave, or all end
    there), which prices every whole (b, d) exactly, the cost being linear in d; a state
    of b sessions runs at most b x cap_n items, at t_n(b).
  - The LM head runs on the client's CPU, or on the GPU of the node where the session ends
    (at that node's batch-1 time at least), which then holds it in memory: that visit's
    layers are at most what the node holds next to the head.

Any k real sessions are a feasible point (their classes, clients, visits, covers, items,
where they begin and end and run the head, each node's state), whose cost is at most their
real total time, so B(k) is at most that total. B is convex in k (the optimum of an LP in
its right-hand side), so its increments t_k = B(k) - B(k-1) are ascending, and for every k
the k fastest real sessions take at least t_1 + ... + t_k together; 1 / x is convex and
decreasing, so the real sum of 1 / time per token is at most the sum of 1 / t_k (step 5
of upper_bound.py).

B is solved at a few k; the tangents there (B(k_i) plus the dual price of the session
count times k - k_i) are below B everywhere, and so is their maximum, which is convex: its
increments bound like B's. B(1) is solved exactly, so the first increment is positive.

Way (f), `tiered_bound_tokens_per_s`, prices the same parts with every session in one
placement at once: B(k) lets each k pick the placement that suits it best.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import OptimizeResult, linprog
from scipy.sparse import coo_matrix

from .regions import AccessLine, Site, rtt_ms
from .swarm import (
    Swarm,
    client_head_time_s,
    handoff_s,
    head_time_s,
    layer_capacity,
    layer_time_s,
    nearest_peer_s,
)

log = logging.getLogger(__name__)

SOLVED_POINTS = 12  # counts of sessions at which B is solved; tangents fill the rest


def joint_bound_tokens_per_s(lp: SessionsLP) -> float:
    """Sum over k of 1 / (B(k) - B(k-1)) for up to one session per client of `lp`.
    Infinity when the increments prove nothing (not all positive)."""
    most = lp.clients
    points = sorted({1, most, *np.linspace(1, most, SOLVED_POINTS).round().astype(int)})
    tangents: list[tuple[int, float, float]] = []
    for k in points:
        try:
            solved = lp.solve(k)
        except Unsolved as err:  # way (e) proves nothing here; the other ways still do
            log.warning("%s; the bound leaves way (e) out", err)
            return math.inf
        if solved is None:  # more sessions than the nodes can carry: the count ends here
            most = min(most, k - 1)
            break
        tangents.append((k, *solved))
    if most < 1 or not tangents or tangents[0][0] != 1:
        return math.inf
    ks = np.arange(0, most + 1)
    envelope = np.max([value + slope * (ks - k) for k, value, slope in tangents], axis=0)
    envelope[0] = 0.0
    envelope[1] = tangents[0][1]  # solved exactly
    envelope = np.maximum.accumulate(np.maximum(envelope, 0.0))
    increments = np.diff(envelope)
    if not (increments > 0).all():
        return math.inf
    return float((1.0 / increments).sum())


class SessionsLP:
    """min total time of k sessions (module docstring), as `linprog` wants it, over the
    swarm's nodes that hold a layer; `clients`: those admission can take, one session
    each."""

    def __init__(self, swarm: Swarm, clients: Sequence[Site]) -> None:
        self.swarm, self.sites, self.clients = swarm, list(clients), len(clients)
        self._solved: dict[int, tuple[float, float] | None] = {}
        shape = _Shape(swarm, clients)
        lp = self._lp = _Program()
        block = _sessions(lp, shape, lp.var)
        _nodes(lp, shape, [block])
        self._count_row = len(lp.b_eq)
        lp.row_eq([(col, 1.0) for col in block.sessions], 0.0)  # set to k by solve()
        self._a_ub, self._a_eq = lp.matrices()
        self._bounds = lp.bounds()

    def solve(self, k: int) -> tuple[float, float] | None:
        """B(k) and its slope there (the dual price of one more session); None when k
        sessions do not fit."""
        if k not in self._solved:
            lp = self._lp
            b_eq = np.array(lp.b_eq)
            b_eq[self._count_row] = k
            result = _solve(lp, self._a_ub, self._a_eq, b_eq, self._bounds, f"for {k} sessions")
            self._solved[k] = (
                None
                if result is None
                else (float(result.fun), float(result.eqlin.marginals[self._count_row]))
            )
        return self._solved[k]


class _Shape:
    """The swarm as the LPs see it: the nodes that hold a layer, what they hold, their
    round trips and hop charges, the classes of regions, and the clients' homes."""

    def __init__(self, swarm: Swarm, clients: Sequence[Site], merged: bool = False) -> None:
        model, params = swarm.model, swarm.params
        self.model, self.params, self.clients = model, params, list(clients)
        self.nodes = nodes = [
            n for n in swarm.nodes.values() if layer_capacity(n, model, params) > 0
        ]
        self.caps = [layer_capacity(n, model, params) for n in nodes]
        at = [swarm.index[n.node_id] for n in nodes]
        rtt = swarm.rtt_ms[np.ix_(at, at)] / 1000.0
        self.slots, self.n_layers, self.count = params.slots, model.num_layers, len(nodes)
        self.regions = sorted({n.site.region for n in nodes})
        self.region_of = np.array([self.regions.index(n.site.region) for n in nodes])
        every = range(len(self.regions))
        # merged: the sessions that touch three regions or more form one class, which
        # may visit every region, touches at least three and pays the cheapest crossings
        # of any three (a relaxation: fewer columns, for the tiered LP that repeats them
        # per tier); one region and two keep their classes.
        self.mixed = len(self.regions) > 3 and merged
        sizes = [1, 2, len(self.regions)] if self.mixed else range(1, len(self.regions) + 1)
        self.classes = [frozenset(c) for size in sizes for c in itertools.combinations(every, size)]
        self.node_classes = [
            [ci for ci, cls in enumerate(self.classes) if self.region_of[n] in cls]
            for n in range(self.count)
        ]
        self.nearest = nearest_peer_s(rtt)
        self.access = np.array([n.site.access.rtt_ms for n in nodes]) / 1000.0
        self.entering, self.crossing = _hop_charges(
            rtt, self.nearest, self.region_of, len(self.regions)
        )
        self.home = [c.region for c in clients]
        self.homes = sorted(set(self.home))
        self.backbone = np.array(
            [[rtt_ms(_bare(h), _bare(r)) for r in self.regions] for h in self.homes]
        )
        self.unit = [handoff_s(node, model, 1) for node in nodes]
        self.head_bytes = model.head_params * 2
        self.head_caps = [layer_capacity(node, model, params, self.head_bytes) for node in nodes]


@dataclass
class _Block:
    """The columns of one group of sessions: its session counts (per home and class), its
    clients, and per node its visits, its ends, its layer items and its hops out at each
    batch size of the node."""

    sessions: list[int]
    clients: list[int]
    visits: list[list[int]]
    ends: list[list[int]]
    items: dict[tuple[int, int], int]
    leaving: dict[tuple[int, int], int]


Var = Callable[[float, float], int]


def _sessions(lp: _Program, shape: _Shape, var: Var) -> _Block:
    """A group of sessions and every row that holds for any group on its own (the module
    docstring); `var(cost, upper)` makes its columns. What the group takes of each node
    is left to `_nodes`, which joins all groups."""
    model, params, clients = shape.model, shape.params, shape.clients
    count, slots, n_layers, caps = shape.count, shape.slots, shape.n_layers, shape.caps
    classes, node_classes, region_of = shape.classes, shape.node_classes, shape.region_of
    homes, home, access, entering = shape.homes, shape.home, shape.access, shape.entering
    row_ub, row_eq = lp.row_ub, lp.row_eq
    # Client legs: RTT(c, first) / 2 + RTT(c, last) / 2 = c's access line + half the
    # backbone to the first node's region and to the last one's + half of each of the
    # two nodes' access lines. c's line goes on c, the backbone on where the session
    # begins and ends, the nodes' lines on its first visit (less the entering charge
    # that visit carries but no hop pays) and on its end.

    # u[c]: client c is served (its access line, both legs); y[h, R]: sessions of class
    # R from clients of region h.
    u = [var(c.access.rtt_ms / 1000.0, 1.0) for c in clients]
    crossings = [_tree_weight(shape.crossing, cls) for cls in classes]
    if shape.mixed:
        crossings[-1] = min(
            _tree_weight(shape.crossing, frozenset(three))
            for three in itertools.combinations(classes[-1], 3)
        )
    y = {
        (hi, ci): var(crossings[ci] + client_head_time_s(model, params), math.inf)
        for hi in range(len(homes))
        for ci in range(len(classes))
    }
    for hi, h in enumerate(homes):
        row_eq(
            [(u[c], 1.0) for c in range(len(clients)) if home[c] == h]
            + [(y[hi, ci], -1.0) for ci in range(len(classes))],
            0.0,
        )
    v = {(n, ci): var(entering[n], math.inf) for n in range(count) for ci in node_classes[n]}
    e = {(n, ci): var(access[n] / 2, math.inf) for n in range(count) for ci in node_classes[n]}
    first = {
        (n, ci): var(access[n] / 2 - entering[n], math.inf)
        for n in range(count)
        for ci in node_classes[n]
    }
    z = {(n, ci): var(0.0, math.inf) for n in range(count) for ci in node_classes[n]}
    # w[n, b]: items n runs while it serves b sessions, each at the layer time of its
    # whole batch (at most cap_n a session: the state rows of `_nodes`).
    w = {
        (n, b): var(layer_time_s(shape.nodes[n], model, params, b), math.inf)
        for n in range(count)
        for b in range(1, slots + 1)
    }
    # x[n, b]: hops out of n while it serves b sessions, each at least nearest_n / 2 + its
    # hand-off of the whole batch (b x u_n).
    x = {
        (n, b): var(shape.nearest[n] / 2 + b * shape.unit[n], math.inf)
        for n in range(count)
        for b in range(1, slots + 1)
    }
    # h[n, ci]: ends on n that run the LM head on n's GPU, not the client's CPU (what y
    # pays); only where n holds the head at all, its layers then at most head_caps[n].
    client_head = client_head_time_s(model, params)
    head_caps = shape.head_caps
    h = {
        (n, ci): var(head_time_s(shape.nodes[n], model, params, 1) - client_head, math.inf)
        for n in range(count)
        if shape.nodes[n].budget_bytes >= shape.head_bytes
        for ci in node_classes[n]
    }
    for n in range(count):
        mine = node_classes[n]
        row_eq(
            [(z[n, ci], 1.0) for ci in mine] + [(w[n, b], -1.0) for b in range(1, slots + 1)],
            0.0,
        )
        row_eq(
            [(x[n, b], 1.0) for b in range(1, slots + 1)]
            + [(v[n, ci], -1.0) for ci in mine]
            + [(e[n, ci], 1.0) for ci in mine],
            0.0,
        )
        for ci in mine:  # at most cap_n items a visit (fewer next to the head)
            lost = [(h[n, ci], float(caps[n] - head_caps[n]))] if (n, ci) in h else []
            row_ub([(z[n, ci], 1.0), (v[n, ci], -float(caps[n])), *lost], 0.0)
            row_ub([(e[n, ci], 1.0), (v[n, ci], -1.0)], 0.0)  # ends are visits
            row_ub([(first[n, ci], 1.0), (v[n, ci], -1.0)], 0.0)
            if caps[n] < n_layers:
                # A session that begins and ends on n, which cannot hold it alone, left
                # n and came back: v - e does not count that hop out of n, nor the
                # entry back in. At least first + e - v sessions did so, each paying
                # n's nearest half, a hand-off and the entering charge.
                back = var(shape.nearest[n] / 2 + shape.unit[n] + entering[n], math.inf)
                row_ub([(first[n, ci], 1.0), (e[n, ci], 1.0), (v[n, ci], -1.0), (back, -1.0)], 0.0)
            if (n, ci) in h:
                row_ub([(h[n, ci], 1.0), (e[n, ci], -1.0)], 0.0)
    for ci in range(len(classes)):
        sessions = [y[hi, ci] for hi in range(len(homes))]
        members = [n for n in range(count) if ci in node_classes[n]]
        # A session visits a node once: v[n, R] counts the sessions that pass n (one
        # that came back would count once, its extra hop left uncharged), so a few fast
        # nodes cannot give each of a few sessions more visits than there are nodes.
        for n in members:
            row_ub([(v[n, ci], 1.0)] + [(col, -1.0) for col in sessions], 0.0)
        # A class's sessions take L layer items each, from its own regions' nodes...
        row_ub(
            [(col, float(n_layers)) for col in sessions] + [(z[n, ci], -1.0) for n in members],
            0.0,
        )
        # ...in whole visits...
        _whole_visits(
            lp,
            sessions,
            [(v[n, ci], h.get((n, ci)), caps[n], head_caps[n]) for n in members],
            n_layers,
        )
        # ...visit each of them (the class is the regions a session touches; a merged
        # class's sessions touch three at least, so they leave any two of them)...
        if shape.mixed and ci == len(classes) - 1:
            for pair in itertools.combinations(classes[ci], 2):
                row_ub(
                    [(col, 1.0) for col in sessions]
                    + [(v[n, ci], -1.0) for n in members if region_of[n] not in pair],
                    0.0,
                )
        else:
            for r in classes[ci]:
                row_ub(
                    [(col, 1.0) for col in sessions]
                    + [(v[n, ci], -1.0) for n in members if region_of[n] == r],
                    0.0,
                )
        # ...and begin and end exactly once, each time in one of them: where[hi, r] of
        # those from clients in homes[hi] do so in region r, and their legs cross the
        # backbone between the two there (half a round trip each way).
        for ends in (first, e):
            where = {
                (hi, r): var(float(shape.backbone[hi, r]) / 2000.0, math.inf)
                for hi in range(len(homes))
                for r in classes[ci]
            }
            for hi in range(len(homes)):
                row_eq([(y[hi, ci], -1.0)] + [(where[hi, r], 1.0) for r in classes[ci]], 0.0)
            for r in classes[ci]:
                row_eq(
                    [(where[hi, r], 1.0) for hi in range(len(homes))]
                    + [(ends[n, ci], -1.0) for n in members if region_of[n] == r],
                    0.0,
                )
    return _Block(
        sessions=list(y.values()),
        clients=u,
        visits=[[v[n, ci] for ci in node_classes[n]] for n in range(count)],
        ends=[[e[n, ci] for ci in node_classes[n]] for n in range(count)],
        items=w,
        leaving=x,
    )


def _nodes(lp: _Program, shape: _Shape, blocks: Sequence[_Block]) -> None:
    """Every node's state, shared by all groups of sessions: a node serving b sessions,
    d of which end there, is a mix of whole states (b sessions that all leave, or all end
    there), which prices every whole (b, d) exactly (the cost being linear in d); a state
    of b sessions runs at most b x cap_n items, at t_n(b), and sends at most b sessions on.
    Each client has one session at most."""
    slots, caps = shape.slots, shape.caps
    states = [(b, ends) for b in range(1, slots + 1) for ends in (False, True)]
    for n in range(shape.count):
        state = {(b, ends): lp.var(0.0, 1.0) for b, ends in states}
        visits = [(col, 1.0) for block in blocks for col in block.visits[n]]
        ends = [(col, 1.0) for block in blocks for col in block.ends[n]]
        lp.row_ub(visits, float(slots))
        lp.row_ub([(col, 1.0) for col in state.values()], 1.0)
        lp.row_eq(visits + [(state[b, e], -float(b)) for b, e in states], 0.0)
        lp.row_eq(ends + [(state[b, True], -float(b)) for b in range(1, slots + 1)], 0.0)
        for b in range(1, slots + 1):
            lp.row_ub(
                [(block.items[n, b], 1.0) for block in blocks]
                + [(state[b, e], -float(b * caps[n])) for e in (False, True)],
                0.0,
            )
            lp.row_ub(
                [(block.leaving[n, b], 1.0) for block in blocks] + [(state[b, False], -float(b))],
                0.0,
            )
    if len(blocks) > 1:
        for c in range(len(shape.clients)):
            lp.row_ub([(block.clients[c], 1.0) for block in blocks], 1.0)


def _solve(
    lp: _Program,
    a_ub: coo_matrix,
    a_eq: coo_matrix,
    b_eq: np.ndarray,
    bounds: list[tuple[float, float | None]],
    what: str,
) -> OptimizeResult | None:
    """HiGHS' interior point with crossover (the simplex is several times slower on these,
    and crossover keeps the dual prices exact); None when infeasible."""
    result = linprog(
        lp.costs,
        A_ub=a_ub,
        b_ub=lp.b_ub,
        A_eq=a_eq,
        b_eq=b_eq,
        bounds=bounds,
        method="highs-ipm",
    )
    if result.status == 2:  # infeasible
        return None
    if result.status != 0:
        raise Unsolved(f"the sessions LP {what} did not solve: {result.message}")
    return result


class _Program:
    """A linear program built a variable and a row at a time: min costs . x, rows of
    (column, coefficient) terms, 0 <= x <= upper."""

    def __init__(self) -> None:
        self.costs: list[float] = []
        self.upper: list[float] = []  # inf: none
        self.rows_ub: list[tuple[int, int, float]] = []  # (row, column, coefficient)
        self.b_ub: list[float] = []
        self.rows_eq: list[tuple[int, int, float]] = []
        self.b_eq: list[float] = []

    def var(self, cost: float, bound: float = math.inf) -> int:
        self.costs.append(cost)
        self.upper.append(bound)
        return len(self.costs) - 1

    def row_ub(self, terms: list[tuple[int, float]], rhs: float) -> None:
        """sum of terms <= rhs"""
        row = len(self.b_ub)
        self.rows_ub.extend((row, col, coef) for col, coef in terms)
        self.b_ub.append(rhs)

    def row_eq(self, terms: list[tuple[int, float]], rhs: float) -> None:
        """sum of terms == rhs"""
        row = len(self.b_eq)
        self.rows_eq.extend((row, col, coef) for col, coef in terms)
        self.b_eq.append(rhs)

    def bounds(self) -> list[tuple[float, float | None]]:
        return [(0.0, None if math.isinf(top) else top) for top in self.upper]

    def matrices(self) -> tuple[coo_matrix, coo_matrix]:
        """The <= rows and the == rows as sparse matrices."""
        width = len(self.costs)
        return _sparse(self.rows_ub, len(self.b_ub), width), _sparse(
            self.rows_eq, len(self.b_eq), width
        )


def _whole_visits(
    lp: _Program,
    sessions: list[int],
    visits: list[tuple[int, int | None, int, int]],
    n_layers: int,
) -> None:
    """Rows that make a class's sessions (`sessions`: their columns) visit its nodes in
    whole visits. `visits`: per node, its visits' column, its GPU heads' column (None: the
    head does not fit), its capacity and its capacity next to the head.

    Rounding: a session's visits hold >= L layers between them, so for any grain g their
    capacities in grains, rounded up, add up to >= ceil(L / g) (the items alone let a
    session on 12-layer nodes make 6.67 visits of 80 layers, where it makes 7). Covers:
    each session makes one of `_covers`; the class visits each kind of node at least as
    often as its sessions' covers do, and runs the head on the GPU of a kind of node only
    as often as they end there with it.
    """
    caps = [cap for _, _, cap, _ in visits]
    head_caps = [head_cap for _, _, _, head_cap in visits]
    for need, grains in _whole_visit_cuts(caps + head_caps, n_layers):
        lp.row_ub(
            [(col, float(need)) for col in sessions]
            + [(v, -float(grains[cap])) for v, _, cap, _ in visits]
            + [(h, float(grains[cap] - grains[hc])) for _, h, cap, hc in visits if h is not None],
            0.0,
        )
    kind_of, covers = _covers(
        caps, [hc if h is not None else None for _, h, _, hc in visits], n_layers
    )
    x = [lp.var(0.0) for _ in covers]
    lp.row_eq([(col, -1.0) for col in sessions] + [(col, 1.0) for col in x], 0.0)
    for kind in set(kind_of):
        ours = [node for node, k in zip(visits, kind_of, strict=True) if k == kind]
        lp.row_ub(
            [(col, float(c.visits(kind))) for col, c in zip(x, covers, strict=True)]
            + [(v, -1.0) for v, _, _, _ in ours],
            0.0,
        )
        lp.row_ub(
            [(h, 1.0) for _, h, _, _ in ours if h is not None]
            + [
                (col, -1.0)
                for col, c in zip(x, covers, strict=True)
                if c.end == kind and c.gpu_head
            ],
            0.0,
        )


class Unsolved(Exception):
    """HiGHS stopped without an optimum (an iteration limit, numerical trouble)."""


def _bare(region: str) -> Site:
    """A site of `region` whose access line adds nothing (clients' own lines are priced
    apart)."""
    return Site(region, AccessLine("none", 0.0, 1.0, 1.0))


def _hop_charges(
    rtt: np.ndarray, nearest: np.ndarray, region_of: np.ndarray, regions: int
) -> tuple[np.ndarray, np.ndarray]:
    """What a hop n -> m costs beyond the sender's nearest-peer half RTT (charged on its
    hop items), RTT(n, m) / 2 - nearest_n / 2, split in two parts that are never negative:
    entering[m], the least any hop into m pays (a far node's own access line), and
    crossing[a, b], the least a hop between regions a and b pays on top of that, either
    way round."""
    beyond = (rtt - nearest[:, None]) / 2
    np.fill_diagonal(beyond, np.inf)
    entering = np.maximum(beyond.min(axis=0), 0.0) if len(rtt) > 1 else np.zeros(len(rtt))
    rest = beyond - entering[None, :]
    crossing = np.zeros((regions, regions))
    for a in range(regions):
        for b in range(regions):
            if a != b:
                block = rest[np.ix_(region_of == a, region_of == b)]
                crossing[a, b] = max(0.0, float(block.min()))
    return entering, np.minimum(crossing, crossing.T)


COVERS_AT_MOST = 400  # per class: beyond that, nodes' kinds merge (`_covers`)


@dataclass(frozen=True)
class _Cover:
    """One way to cover L layers: the kind of the node a session ends on, whether that
    node runs the LM head, and the kinds of its other visits."""

    end: int
    gpu_head: bool
    others: tuple[int, ...]

    def visits(self, kind: int) -> int:
        return self.others.count(kind) + (self.end == kind)


def _covers(
    caps: Sequence[int], head_caps: Sequence[int | None], n_layers: int
) -> tuple[list[int], list[_Cover]]:
    """Each node's kind, and the covers a session's visits always contain one of.

    A kind is a capacity (next to the head: the most any node of the kind holds there;
    None: the head fits on none); a node's kind is the least one at or above its own
    capacity. A session's visits hold >= L layers, and still do counted at their kinds'
    capacities, so dropping visits other than its end leaves a minimal cover: at least
    that many visits to each kind, and a GPU head at that kind of end. Kinds merge, the
    two nearest capacities into the larger, until the covers are at most COVERS_AT_MOST.
    """
    kinds = sorted(set(caps))
    while True:
        kind_of = [bisect.bisect_left(kinds, c) for c in caps]
        head: list[int | None] = [None] * len(kinds)
        for held, k in zip(head_caps, kind_of, strict=True):
            if held is not None:
                head[k] = max(held, head[k] or 0)
        covers = _minimal_covers(kinds, head, n_layers)
        if covers is not None or len(kinds) == 1:
            return kind_of, covers or []
        nearest = min(range(len(kinds) - 1), key=lambda i: kinds[i + 1] / kinds[i])
        del kinds[nearest]


def _minimal_covers(kinds: list[int], head: list[int | None], n_layers: int) -> list[_Cover] | None:
    """For each end (a kind, its head on the client's CPU or, where it fits, on the
    node's GPU), every multiset of other kinds that covers the rest of L and drops below it
    without its smallest; None past COVERS_AT_MOST."""
    order = sorted(range(len(kinds)), key=lambda i: -kinds[i])
    out: list[_Cover] = []

    def grow(end: int, gpu: bool, start: int, need: int, taken: list[int]) -> bool:
        for j in range(start, len(order)):
            taken.append(order[j])
            if need <= kinds[order[j]]:
                out.append(_Cover(end, gpu, tuple(taken)))
            elif not grow(end, gpu, j, need - kinds[order[j]], taken):
                return False
            taken.pop()
            if len(out) > COVERS_AT_MOST:
                return False
        return True

    for end in range(len(kinds)):
        for gpu, held in ((False, kinds[end]), (True, head[end])):
            if held is None:
                continue
            if held >= n_layers:
                out.append(_Cover(end, gpu, ()))
            elif not grow(end, gpu, 0, n_layers - held, []):
                return None
    return out


def _whole_visit_cuts(caps: Sequence[int], n_layers: int) -> list[tuple[int, dict[int, int]]]:
    """Rounding cuts for sessions that need `n_layers` from visits of `caps` layers each:
    for a grain g, sum over visits of ceil(cap / g) >= ceil(sum of caps / g) >=
    ceil(L / g). One (ceil(L / g), {cap: ceil(cap / g)}) per distinct row, for g = 1 up to
    the largest cap (above it every cap is one grain and the need only falls)."""
    kinds = sorted(set(caps))
    rows: dict[tuple[float, ...], tuple[int, dict[int, int]]] = {}
    for g in range(1, max(max(kinds), 1) + 1):
        need = -(-n_layers // g)
        grains = {c: -(-c // g) for c in kinds}
        # What each cap counts for, in layers: a row is implied by one that counts every
        # cap for no more, so only the least ones are kept.
        rows.setdefault(tuple(grains[c] * n_layers / need for c in kinds), (need, grains))
    return [
        row
        for worth, row in rows.items()
        if not any(other != worth and all(map(float.__le__, other, worth)) for other in rows)
    ]


def _tree_weight(w: np.ndarray, regions: frozenset[int]) -> float:
    """The lightest spanning tree over `regions` (Prim): the crossings a session that
    touches all of them makes at least."""
    members = sorted(regions)
    if len(members) < 2:
        return 0.0
    inside = {members[0]}
    total = 0.0
    while len(inside) < len(members):
        weight, nxt = min((w[a, b], b) for a in inside for b in members if b not in inside)
        total += weight
        inside.add(nxt)
    return total


def _sparse(entries: list[tuple[int, int, float]], rows: int, cols: int) -> coo_matrix:
    if not entries:
        return coo_matrix((rows, cols))
    r, c, data = zip(*entries, strict=True)
    return coo_matrix((data, (r, c)), shape=(rows, cols))


TIER_RATIO = 1.2  # a tier's top over its bottom: the chord of 1 / t is within 0.5 % there
TIER_SPAN = 20.0  # the last tier, open above, starts at this many times the fastest session


def tiered_bound_tokens_per_s(lp: SessionsLP) -> float:
    """Way (f): served tokens/s of one placement at most, all sessions in it together.

    Way (e) bounds the k fastest sessions by B(k) for each k apart, each k with the
    placement that suits it best: its first sessions run alone on the best nodes at batch
    1 while its last ones pay for a full swarm. Here every session is in the same swarm.
    Sessions fall into tiers by their time per token, [lo, hi) with hi = TIER_RATIO x lo
    from B(1) (no session is faster) up; a tier is a group of sessions with columns of its
    own, all tiers sharing the nodes' states, slots and batches (`_nodes`), each client
    in one tier at most. For a time t in [lo, hi], 1 / t is at most its chord, 1 / lo +
    1 / hi - t / (lo hi), so a tier's n sessions of total time T serve at most
    n (1 / lo + 1 / hi) - T / (lo hi), with lo n <= T <= hi n, and T at least the tier's
    cost as way (e) prices it. The last tier, open above from the first edge at or past
    TIER_SPAN x B(1), serves 1 / lo a session. The LP maximises the sum over tiers; any
    real placement is a feasible point (each session in the tier of its time, T its
    tier's real total), whose value is at least its served tokens/s. The classes of
    three regions or more merge into one (`_Shape`) to keep the LP small: it touches
    three regions at least and pays the cheapest crossings of any three, a relaxation, so
    still a bound. Infinity when the LP does not solve.
    """
    try:
        fastest = lp.solve(1)
    except Unsolved as err:
        log.warning("%s; the bound leaves way (f) out", err)
        return math.inf
    if fastest is None:
        return 0.0
    shape = _Shape(lp.swarm, lp.sites, merged=True)
    program = _Program()
    tiers = int(math.ceil(math.log(TIER_SPAN) / math.log(TIER_RATIO)))
    edges = [fastest[0] * TIER_RATIO**i for i in range(tiers + 1)]
    blocks = []
    for lo, hi in zip(edges, [*edges[1:], math.inf], strict=True):
        priced: list[tuple[int, float]] = []

        def var(cost: float, upper: float, priced: list[tuple[int, float]] = priced) -> int:
            col = program.var(0.0, upper)
            if cost:
                priced.append((col, cost))
            return col

        block = _sessions(program, shape, var)
        blocks.append(block)
        # linprog minimises: the negated tokens/s.
        for col in block.sessions:
            program.costs[col] = -1.0 / lo if math.isinf(hi) else -(1.0 / lo + 1.0 / hi)
        if math.isinf(hi):
            continue
        total = program.var(1.0 / (lo * hi))
        program.row_ub([*priced, (total, -1.0)], 0.0)
        program.row_ub([(col, lo) for col in block.sessions] + [(total, -1.0)], 0.0)
        program.row_ub([(total, 1.0)] + [(col, -hi) for col in block.sessions], 0.0)
    _nodes(program, shape, blocks)
    a_ub, a_eq = program.matrices()
    try:
        result = _solve(program, a_ub, a_eq, np.array(program.b_eq), program.bounds(), "in tiers")
    except Unsolved as err:
        log.warning("%s; the bound leaves way (f) out", err)
        return math.inf
    return math.inf if result is None else -float(result.fun)
