"""An upper bound on served tokens/s that no placement or router can beat in this model.

Relax everything a placement decides and keep only what the hardware imposes:
  * KV slots: node n offers `slots` sessions, each over at most cap_n layers (its memory
    with nothing else on it), so the swarm holds slots * sum(cap_n) layer-slots, and a
    session needs L of them.
  * Each layer-slot on node n costs a session at least t_n(1) per token (one layer at
    batch 1). Each session also pays a network floor: the cheapest client round trip, plus
    (h_min - 1) of the cheapest one-way node-to-node delays and hand-offs, where h_min =
    ceil(L / max cap) is the fewest hops any session can take.
  * A session's rate is 1 / (floor + sum of its layer-slot costs), a convex decreasing
    function of that sum; the sum of rates over a partition of the layer-slots into
    sessions is largest when the cheapest L slots form one session, the next L the next,
    and so on (the sorted partition majorises every other).
  * Compute: node n never does more than slots / t_n(slots) layer-tokens per second, so
    tokens/s <= sum over nodes of that / L.
The bound is the smaller of the two. It is loose where a good placement must mix slow and
fast nodes or cross regions; it is tight for a homogeneous swarm in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .regions import Site, rtt_ms
from .swarm import Swarm, handoff_s, layer_capacity, layer_time_s


def upper_bound_tokens_per_s(swarm: Swarm, clients: Sequence[Site]) -> float:
    model, params = swarm.model, swarm.params
    nodes = list(swarm.nodes.values())
    slots = params.slots
    caps = np.array([layer_capacity(n, model, params) for n in nodes])
    usable = caps > 0
    if caps.sum() < model.num_layers:
        return 0.0
    nodes = [n for n, ok in zip(nodes, usable, strict=True) if ok]
    caps = caps[usable]
    t1 = np.array([layer_time_s(n, model, params, 1) for n in nodes])
    ts = np.array([layer_time_s(n, model, params, slots) for n in nodes])

    h_min = int(np.ceil(model.num_layers / caps.max()))
    client_floor = min(rtt_ms(c, n.site) for c in clients for n in nodes) / 1000.0
    floor = client_floor
    if h_min > 1:
        node_rtt = swarm.rtt_ms
        idx = [swarm.index[n.node_id] for n in nodes]
        sub = node_rtt[np.ix_(idx, idx)]
        cheapest_hop = sub[~np.eye(len(idx), dtype=bool)].min() / 2000.0
        cheapest_handoff = min(handoff_s(n, model, 1) for n in nodes)
        floor += (h_min - 1) * (cheapest_hop + cheapest_handoff)

    slot_costs = np.sort(np.repeat(t1, caps * slots))
    sessions = len(slot_costs) // model.num_layers
    grouped = slot_costs[: sessions * model.num_layers].reshape(sessions, model.num_layers)
    kv_bound = float((1.0 / (floor + grouped.sum(axis=1))).sum())
    compute_bound = float((slots / ts).sum()) / model.num_layers
    return min(kv_bound, compute_bound)
