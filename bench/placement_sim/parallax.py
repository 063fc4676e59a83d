"""Parallax, re-implemented from the description in /work/shared/ANCHORS.md (arXiv 2509.26182).

Phase 1, layer allocation:
  * Nodes are sorted by capacity (layers their memory holds), largest first.
  * A dynamic program over that order finds s*(k), the fewest stages (nodes) that make k
    disjoint full pipelines. A pipeline here is a run of consecutive nodes in capacity
    order (so pipelines are built from similar cards), and nodes may be skipped. The
    embedding and LM head go on a pipeline's first and last node, so a pipeline needs
    L + (embedding and head, in layers) of capacity.
  * It picks the k that maximises k^2 / s*(k).
  * Each pipeline's layers are split by water-filling in proportion to the nodes' speed
    (the roofline time of a layer, which folds in compute and memory bandwidth), within
    each node's capacity.
  * Nodes left over replicate the least-covered layers (the window of their size with
    the lowest mean replica count).
Churn: a join lands on the least-replicated layers. After a leave, a global rebalance
(phase 1 from scratch) runs when a layer has no holder or when the coefficient of
variation of per-layer load passes CV_THRESHOLD. The anchor names no threshold; 0.25 is
ours (a fresh allocation sits at 0.01-0.07 on our scenarios).

Phase 2, routing: a DP over the contiguous ranges of all replicas finds the cheapest chain
covering [0, L). A hop may enter a node's range part-way (its earlier layers are skipped)
and leaves at the range's end. Vertex cost: the node's layers at its would-be batch
(overload-aware roofline latency); edge cost: the RTT between the two nodes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from .regions import Site
from .swarm import Hop, SimNode, Swarm, ceil_div, fetched_bytes, per_layer_bytes

CV_THRESHOLD = 0.25
_INF = np.iinfo(np.int32).max // 2


# ---- phase 1 -------------------------------------------------------------------------------


def stage_counts(capacities: list[int], need: int) -> np.ndarray:
    """s*(k) for k = 0..K over capacity-sorted nodes (largest first); INF when impossible.

    f[i][k]: fewest nodes among the first i that form k pipelines, each a run of
    consecutive nodes whose capacities sum to >= need. The best run ending at node i is the
    shortest one (f is non-increasing in i), so each step is one vectorised min over k.
    """
    table = pipeline_table(capacities, need)
    return table[-1]


def pipeline_table(capacities: list[int], need: int) -> np.ndarray:
    n = len(capacities)
    prefix = np.concatenate([[0], np.cumsum(capacities)])
    k_max = int(prefix[-1] // need) if need > 0 else 0
    table = np.full((n + 1, k_max + 1), _INF, dtype=np.int32)
    table[:, 0] = 0
    j = 0  # largest j with prefix[i] - prefix[j] >= need, found by a moving pointer
    for i in range(1, n + 1):
        table[i] = table[i - 1]
        if prefix[i] < need or k_max == 0:
            continue
        while j + 1 < i and prefix[i] - prefix[j + 1] >= need:
            j += 1
        candidate = table[j, :-1] + (i - j)
        np.minimum(table[i, 1:], candidate, out=table[i, 1:])
    return table


def best_pipeline_count(counts: np.ndarray) -> int:
    """The k maximising k^2 / s*(k) (larger k on ties); 0 when no pipeline is possible."""
    best_k, best_score = 0, 0.0
    for k in range(1, len(counts)):
        if counts[k] >= _INF:
            continue
        score = k * k / counts[k]
        if score >= best_score:
            best_k, best_score = k, score
    return best_k


def pipelines_for(capacities: list[int], need: int, k: int) -> list[list[int]]:
    """The runs (indices into `capacities`) realising s*(k)."""
    table = pipeline_table(capacities, need)
    prefix = np.concatenate([[0], np.cumsum(capacities)])
    runs: list[list[int]] = []
    i = len(capacities)
    while k > 0:
        if table[i, k] == table[i - 1, k]:
            i -= 1
            continue
        j = i - 1
        while prefix[i] - prefix[j] < need:
            j -= 1
        while j + 1 < i and prefix[i] - prefix[j + 1] >= need:
            j += 1
        runs.append(list(range(j, i)))
        i, k = j, k - 1
    runs.reverse()
    return runs


def water_fill(total: int, weights: list[float], caps: list[int]) -> list[int] | None:
    """Integer layer counts in proportion to `weights`, each in [0, cap], summing to total."""
    if sum(caps) < total:
        return None
    shares = [0.0] * len(weights)
    open_ = [i for i in range(len(weights)) if caps[i] > 0]
    left = float(total)
    while open_:
        weight = sum(weights[i] for i in open_)
        over = [i for i in open_ if left * weights[i] / weight >= caps[i]]
        if not over:
            for i in open_:
                shares[i] = left * weights[i] / weight
            break
        for i in over:
            shares[i] = float(caps[i])
            left -= caps[i]
            open_.remove(i)
    sizes = [min(caps[i], math.floor(shares[i] + 1e-9)) for i in range(len(shares))]
    by_remainder = sorted(range(len(shares)), key=lambda i: shares[i] - sizes[i], reverse=True)
    missing = total - sum(sizes)
    while missing > 0:
        for i in by_remainder:
            if missing and sizes[i] < caps[i]:
                sizes[i] += 1
                missing -= 1
    return sizes


class ParallaxSystem:
    name = "parallax"
    client_runs_head = False

    def __init__(self, swarm: Swarm, *, cv_threshold: float = CV_THRESHOLD) -> None:
        self.swarm = swarm
        self.cv_threshold = cv_threshold
        self.assigned: dict[str, tuple[int, int]] = {}
        self.rebalances = 0

    # ---- capacities -------------------------------------------------------------------

    def _extra_layers(self) -> tuple[int, int]:
        model, per_layer = self.swarm.model, per_layer_bytes(self.swarm.model, self.swarm.params)
        return (
            ceil_div(model.embed_params * 2, per_layer),
            ceil_div(model.head_params * 2, per_layer),
        )

    def _speed(self, node_id: str) -> float:
        return 1.0 / self.swarm.layer_time_s(node_id, self.swarm.params.slots)

    def _capacity(self, node_id: str, start: int, end_exclusive_span: int) -> int:
        """Layers the node holds for a range starting at `start` with at most this span."""
        model = self.swarm.model
        extra = model.embed_params * 2 if start == 0 else 0
        cap = self.swarm.capacity(node_id, extra)
        if start + cap >= model.num_layers:
            cap = min(cap, self.swarm.capacity(node_id, extra + model.head_params * 2))
        return min(cap, end_exclusive_span)

    # ---- phase 1 ----------------------------------------------------------------------

    def allocate(self) -> dict[str, tuple[int, int]]:
        swarm, n_layers = self.swarm, self.swarm.model.num_layers
        embed_layers, head_layers = self._extra_layers()
        need = n_layers + embed_layers + head_layers
        # A card that holds the whole model with its embedding and head is a pipeline alone.
        capacity = {nid: min(need, swarm.capacity(nid, clip=False)) for nid in swarm.nodes}
        nodes = sorted(
            (nid for nid in swarm.nodes if capacity[nid] > 0),
            key=lambda nid: (-capacity[nid], -self._speed(nid), nid),
        )
        caps = [capacity[nid] for nid in nodes]
        k = best_pipeline_count(stage_counts(caps, need))
        assigned: dict[str, tuple[int, int]] = {}
        for run in pipelines_for(caps, need, k) if k else []:
            members = [nodes[i] for i in run]
            run_caps = []
            for pos, nid in enumerate(members):
                extra = 0
                if pos == 0:
                    extra += swarm.model.embed_params * 2
                if pos == len(members) - 1:
                    extra += swarm.model.head_params * 2
                run_caps.append(swarm.capacity(nid, extra))
            sizes = water_fill(n_layers, [self._speed(nid) for nid in members], run_caps)
            if sizes is None:
                continue
            start = 0
            for nid, size in zip(members, sizes, strict=True):
                if size:
                    assigned[nid] = (start, start + size)
                    start += size
        for nid in nodes:
            if nid not in assigned:
                window = self._least_covered_window(nid, assigned)
                if window:
                    assigned[nid] = window
        return assigned

    def _coverage(self, assigned: Mapping[str, tuple[int, int]]) -> np.ndarray:
        counts = np.zeros(self.swarm.model.num_layers)
        for a, b in assigned.values():
            counts[a:b] += 1
        return counts

    def _least_covered_window(
        self, node_id: str, assigned: Mapping[str, tuple[int, int]]
    ) -> tuple[int, int] | None:
        n_layers = self.swarm.model.num_layers
        coverage = self._coverage(assigned)
        prefix = np.concatenate([[0.0], np.cumsum(coverage)])
        best: tuple[float, int, int] | None = None
        for start in range(n_layers):
            size = self._capacity(node_id, start, n_layers - start)
            if size <= 0:
                continue
            mean = (prefix[start + size] - prefix[start]) / size
            if best is None or mean < best[0] - 1e-12:
                best = (mean, start, start + size)
        return (best[1], best[2]) if best else None

    def load_cv(self) -> float:
        """Coefficient of variation of per-layer load (demand equal on every layer)."""
        capacity = np.zeros(self.swarm.model.num_layers)
        for nid, (a, b) in self.assigned.items():
            capacity[a:b] += self._speed(nid) / (b - a)
        if (capacity <= 0).any():
            return math.inf
        load = 1.0 / capacity
        return float(load.std() / load.mean())

    # ---- PlacementSystem --------------------------------------------------------------

    def start(self) -> None:
        self.assigned = self.allocate()

    def join(self, node: SimNode, now_s: float) -> int:
        window = self._least_covered_window(node.node_id, self.assigned)
        if window is None:
            return 0
        self.assigned[node.node_id] = window
        return fetched_bytes(self.swarm.model, None, window)

    def leave(self, node_id: str, now_s: float) -> int:
        self.assigned.pop(node_id, None)
        if self.load_cv() <= self.cv_threshold:
            return 0
        old = self.assigned
        self.assigned = self.allocate()
        self.rebalances += 1
        return sum(
            fetched_bytes(self.swarm.model, old.get(nid), rng) for nid, rng in self.assigned.items()
        )

    def ranges(self) -> dict[str, tuple[int, int]]:
        return dict(self.assigned)

    def route(self, client: Site, load: Mapping[str, int], full: set[str]) -> list[Hop] | None:
        return parallax_route(self.swarm, self.assigned, client, load, full)


# ---- phase 2 -------------------------------------------------------------------------------


def parallax_route(
    swarm: Swarm,
    assigned: Mapping[str, tuple[int, int]],
    client: Site,
    load: Mapping[str, int],
    full: set[str],
) -> list[Hop] | None:
    """Cheapest chain over the replicas' ranges covering [0, L); None if there is none."""
    ids = [nid for nid in assigned if nid in swarm.nodes and nid not in full]
    if not ids:
        return None
    n_layers = swarm.model.num_layers
    starts = np.array([assigned[nid][0] for nid in ids])
    ends = np.array([assigned[nid][1] for nid in ids])
    per_layer = np.array([swarm.layer_time_s(nid, load.get(nid, 0) + 1) for nid in ids])
    idx = np.array([swarm.index[nid] for nid in ids])
    rtt = swarm.rtt_ms[np.ix_(idx, idx)] / 1000.0
    client_rtt = np.array([swarm.client_rtt_s(client, nid) for nid in ids])

    best = np.full(len(ids), np.inf)  # cheapest chain that ends with this node's range
    parent = np.full(len(ids), -1)
    entry = np.zeros(len(ids), dtype=np.int64)
    for p in range(n_layers):
        covering = np.nonzero((starts <= p) & (p < ends))[0]
        if covering.size == 0:
            return None
        if p == 0:
            reach = client_rtt[covering]
            source = np.full(covering.size, -1)
        else:
            finished = np.nonzero((ends == p) & np.isfinite(best))[0]
            if finished.size == 0:
                continue
            via = best[finished][:, None] + rtt[np.ix_(finished, covering)]
            pick = via.argmin(axis=0)
            reach = via[pick, np.arange(covering.size)]
            source = finished[pick]
        cost = reach + (ends[covering] - p) * per_layer[covering]
        better = cost < best[covering]
        best[covering[better]] = cost[better]
        parent[covering[better]] = source[better]
        entry[covering[better]] = p
    done = np.nonzero(ends == n_layers)[0]
    if done.size == 0:
        return None
    total = best[done] + client_rtt[done]
    last = int(done[total.argmin()])
    if not np.isfinite(best[last]):
        return None
    hops: list[Hop] = []
    node = last
    while node != -1:
        hops.append(Hop(ids[node], int(entry[node]), int(ends[node])))
        node = int(parent[node])
    hops.reverse()
    return hops
