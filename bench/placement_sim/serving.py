"""Serving a stream of sessions on a placement: admission, latency and served tokens/s.

Sessions arrive one after another from clients spread over the scenario's regions. The
system under test routes each one with its own router, given the current load; a session
is admitted when every node on its route still has a free KV slot. Admission stops at the
first session that cannot be routed: the swarm is saturated.

With the admitted sessions in place, every node batches all of its sessions in each decode
step, and a session's time per token is its whole round: client -> hops (layers at the
node's batch, hand-off, one-way delay) -> client (see swarm.session_latency_s).

  served tokens/s = sum over sessions of 1 / (its time per token)

which is Little's law with one token in flight per session. p50/p95 are over the admitted
sessions' time per token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .regions import Site
from .swarm import Hop, Swarm, session_latency_s
from .system import PlacementSystem


@dataclass(frozen=True)
class Served:
    tokens_per_s: float
    sessions: int
    latencies_s: tuple[float, ...]
    mean_hops: float

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        return float(np.percentile(np.array(self.latencies_s), q)) * 1000.0


def throughput_of(
    swarm: Swarm, sessions: Sequence[tuple[Site, list[Hop]]], client_runs_head: bool = False
) -> tuple[float, list[float], dict[str, int]]:
    """Served tokens/s, per-session time per token, and per-node load, for fixed routes."""
    load: Counter[str] = Counter()
    for _, hops in sessions:
        load.update({h.node_id for h in hops})
    latencies = [
        session_latency_s(swarm, client, hops, load, client_runs_head) for client, hops in sessions
    ]
    return sum(1.0 / t for t in latencies), latencies, dict(load)


def saturate(system: PlacementSystem, clients: Sequence[Site]) -> Served:
    swarm = system.swarm
    slots = swarm.params.slots
    load: Counter[str] = Counter()
    sessions: list[tuple[Site, list[Hop]]] = []
    for client in clients:
        full = {nid for nid, n in load.items() if n >= slots}
        hops = system.route(client, load, full)
        if not hops:
            break
        used = {h.node_id for h in hops}
        if used & full:
            break  # the router chose a node without cache: refused, the swarm is saturated
        sessions.append((client, hops))
        load.update(used)
    if not sessions:
        return Served(0.0, 0, (), 0.0)
    tokens_per_s, latencies, _ = throughput_of(swarm, sessions, system.client_runs_head)
    mean_hops = float(np.mean([len(h) for _, h in sessions]))
    return Served(tokens_per_s, len(sessions), tuple(latencies), mean_hops)
