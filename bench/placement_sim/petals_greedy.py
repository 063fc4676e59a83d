"""Petals 2.x, re-implemented from the description in /work/shared/ANCHORS.md.

Block selection: a server's span is what its memory holds (blocks plus their attention
cache; the client runs the embedding and the LM head). It adds up the announced throughput
of every server on each block and takes the window of its span whose *sorted* throughputs
are lexicographically smallest: it covers the weakest part of the chain.

Announced throughput: min(forward_rps / ((n_blocks + 1) / 2), network_rps), where
forward_rps is the tokens/s of one block on a 1,024-token forward pass (compute bound) and
network_rps = min(download, upload) / (hidden_size * 16 bits). Self-reported, unchecked.

Rebalancing: each server re-checks at random times, on average every 120 s. A check
simulates its own greedy move followed by greedy moves of everyone else in random order,
and the server moves only if old bottleneck / new bottleneck < 0.75. Moving restarts the
server with the new span, which reloads every weight of it (Petals issue #389), so the
whole new span counts as fetched.

Routing for inference: a shortest path over (server, block) states. Entering a server
costs RTT/2 + 18 ms of serialisation; every block costs 1 / inference_rps (one token through
one block); a server without free attention cache costs a 10 s penalty. Load plays no other
part (clients route on self-reported numbers).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import numpy as np

from .regions import Site
from .swarm import Hop, SimNode, Swarm, fetched_bytes

BALANCE_QUALITY = 0.75
MEAN_CHECK_INTERVAL_S = 120.0
SERIALISATION_S = 0.018
CACHE_PENALTY_S = 10.0
FORWARD_TOKENS = 1024


def choose_window(totals: np.ndarray, span: int) -> int:
    """Start of the window whose sorted per-block throughputs are lexicographically least.

    Ties go to the lowest start.
    """
    span = min(span, len(totals))
    windows = np.lib.stride_tricks.sliding_window_view(totals, span)
    ordered = np.sort(windows, axis=1)
    # np.lexsort sorts by its last key first: feed the columns smallest-value last.
    return int(np.lexsort(ordered.T[::-1])[0])


def announced_throughput(node: SimNode, swarm: Swarm, n_blocks: int) -> float:
    model = swarm.model
    flops = model.flops_per_token_per_layer(FORWARD_TOKENS // 2)
    forward_rps = node.gpu.fp16_tflops * 1e12 * swarm.params.compute_efficiency / flops
    network_rps = min(node.up_bps, node.down_bps) / (model.hidden * 16)
    return min(forward_rps / ((n_blocks + 1) / 2), network_rps)


class PetalsSystem:
    name = "petals"
    client_runs_head = True

    def __init__(self, swarm: Swarm, *, seed: int = 0, rebalance_on_start: bool = True) -> None:
        self.swarm = swarm
        self.rng = random.Random(seed)
        self.rebalance_on_start = rebalance_on_start
        self.spans: dict[str, tuple[int, int]] = {}
        self.throughput: dict[str, float] = {}
        self.totals = np.zeros(swarm.model.num_layers)
        self.last_event_s = 0.0
        self.moves = 0

    # ---- block selection --------------------------------------------------------------

    def span_of(self, node_id: str) -> int:
        return self.swarm.capacity(node_id)  # blocks + attention cache; no embedding/head

    def _add(self, node_id: str, start: int) -> None:
        span = self.span_of(node_id)
        self.spans[node_id] = (start, start + span)
        self.totals[start : start + span] += self.throughput[node_id]

    def _remove(self, node_id: str) -> tuple[int, int]:
        start, end = self.spans.pop(node_id)
        self.totals[start:end] -= self.throughput[node_id]
        np.maximum(self.totals, 0.0, out=self.totals)  # float dust from add-then-subtract
        return start, end

    def _place_greedily(self, node_id: str) -> int:
        span = self.span_of(node_id)
        self.throughput[node_id] = announced_throughput(self.swarm.nodes[node_id], self.swarm, span)
        start = choose_window(self.totals, span)
        self._add(node_id, start)
        return fetched_bytes(self.swarm.model, None, self.spans[node_id], holds_ends=False)

    # ---- rebalancing ------------------------------------------------------------------

    def should_move(self, node_id: str) -> bool:
        """Simulate this server's move, then everyone else's, and apply the 0.75 rule."""
        old_bottleneck = float(self.totals.min())
        totals = self.totals.copy()
        own = self.throughput[node_id]
        start, end = self.spans[node_id]
        totals[start:end] -= own
        new_start = choose_window(totals, end - start)
        if new_start == start:
            return False
        totals[new_start : new_start + end - start] += own
        spans = dict(self.spans)
        spans[node_id] = (new_start, new_start + end - start)
        others = [nid for nid in spans if nid != node_id]
        self.rng.shuffle(others)
        for other in others:
            a, b = spans[other]
            totals[a:b] -= self.throughput[other]
            moved_to = choose_window(totals, b - a)
            spans[other] = (moved_to, moved_to + b - a)
            totals[moved_to : moved_to + b - a] += self.throughput[other]
        new_bottleneck = float(totals.min())
        if new_bottleneck <= 0:
            return False
        return old_bottleneck / new_bottleneck < BALANCE_QUALITY

    def _checks(self, elapsed_s: float) -> int:
        """Every server checks with the chance that its random timer fired in `elapsed_s`."""
        chance = 1.0 - math.exp(-elapsed_s / MEAN_CHECK_INTERVAL_S)
        order = list(self.spans)
        self.rng.shuffle(order)
        fetched = 0
        for node_id in order:
            if node_id not in self.spans or self.rng.random() >= chance:
                continue
            if self.should_move(node_id):
                self._remove(node_id)
                fetched += self._place_greedily(node_id)  # a restart reloads the whole span
                self.moves += 1
        return fetched

    # ---- PlacementSystem --------------------------------------------------------------

    def start(self) -> None:
        order = list(self.swarm.nodes)
        self.rng.shuffle(order)  # servers join one by one, in no particular order
        for node_id in order:
            if self.span_of(node_id) > 0:
                self._place_greedily(node_id)
        if self.rebalance_on_start:
            self._checks(math.inf)  # everyone has checked once by the time we measure

    def join(self, node: SimNode, now_s: float) -> int:
        fetched = self._place_greedily(node.node_id) if self.span_of(node.node_id) else 0
        return fetched + self._advance(now_s)

    def leave(self, node_id: str, now_s: float) -> int:
        if node_id in self.spans:
            self._remove(node_id)
            self.throughput.pop(node_id, None)
        return self._advance(now_s)

    def _advance(self, now_s: float) -> int:
        elapsed, self.last_event_s = now_s - self.last_event_s, now_s
        return self._checks(max(0.0, elapsed))

    def ranges(self) -> dict[str, tuple[int, int]]:
        return dict(self.spans)

    def route(self, client: Site, load: Mapping[str, int], full: set[str]) -> list[Hop] | None:
        return petals_route(self.swarm, self.spans, client, full)


def petals_route(
    swarm: Swarm, spans: Mapping[str, tuple[int, int]], client: Site, full: set[str]
) -> list[Hop] | None:
    """Shortest path over (server, block): the graph is a DAG in the block index."""
    ids = [nid for nid in spans if nid in swarm.nodes]
    if not ids:
        return None
    n_layers = swarm.model.num_layers
    starts = np.array([spans[nid][0] for nid in ids])
    ends = np.array([spans[nid][1] for nid in ids])
    per_block = np.array([swarm.layer_time_s(nid, 1) for nid in ids])  # 1 / inference_rps
    penalty = np.array([CACHE_PENALTY_S if nid in full else 0.0 for nid in ids])
    idx = np.array([swarm.index[nid] for nid in ids])
    half_rtt = swarm.rtt_ms[np.ix_(idx, idx)] / 2000.0
    client_half_rtt = np.array([swarm.client_rtt_s(client, nid) / 2 for nid in ids])

    dist = np.full(len(ids), np.inf)  # cost so far, with block p-1 done on server u
    parents: list[np.ndarray] = []  # per block: the server before each server (-1: client)
    for p in range(n_layers):
        covering = np.nonzero((starts <= p) & (p < ends))[0]
        if covering.size == 0:
            return None
        came_from = np.full(len(ids), -2)
        new = np.full(len(ids), np.inf)
        if p == 0:
            enter = client_half_rtt[covering]
            enter_from = np.full(covering.size, -1)
        else:
            live = np.nonzero(np.isfinite(dist))[0]
            if live.size == 0:
                return None
            via = dist[live][:, None] + half_rtt[np.ix_(live, covering)]
            best = via.argmin(axis=0)
            enter = via[best, np.arange(covering.size)]
            enter_from = live[best]
        enter = enter + SERIALISATION_S + penalty[covering]
        stay = dist[covering]  # inf where the server did not do block p-1
        use_stay = stay <= enter
        new[covering] = np.where(use_stay, stay, enter) + per_block[covering]
        came_from[covering] = np.where(use_stay, covering, enter_from)
        dist = new
        parents.append(came_from)
    last = int(dist.argmin())
    if not np.isfinite(dist[last]):
        return None
    chain = []
    server = last
    for p in range(n_layers - 1, -1, -1):
        chain.append(server)
        server = int(parents[p][server])
    chain.reverse()
    hops: list[Hop] = []
    for p, server in enumerate(chain):
        if hops and hops[-1].node_id == ids[server] and hops[-1].end == p:
            hops[-1] = Hop(ids[server], hops[-1].start, p + 1)
        else:
            hops.append(Hop(ids[server], p, p + 1))
    return hops
