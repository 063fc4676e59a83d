"""An upper bound on served tokens/s that no placement or router can beat in this model.

Relax everything a placement and a router decide, keep only what the hardware and the
network impose, and bound what is left. The argument, step by step (README.md repeats it):

 1. Items. A session that passes node n takes one of its `slots` KV slots and runs there
    k <= cap_n layers (cap_n: layers n's memory holds with nothing else on it; every node
    holds one contiguous range). So the (session, layer) pairs run on n number at most
    slots * cap_n. When n serves b sessions, each of its layers costs every one of them
    t_n(b) >= t_n(j) for every j <= b. So we give node n `slots` chunks of cap_n items, the
    j-th chunk costing t_n(j) per item: any feasible set of sessions can be mapped onto
    items whose cost is no more than what the sessions really pay for compute.
 2. Hops. Every hop out of node n (to a different node) costs at least
    d_n = min over m != n of RTT(n, m) / 2 + hand-off(n, 1), and a session leaves every node
    it visits except the last. Because k <= cap_n, d_n >= d_n * k / cap_n: charging
    d_n / cap_n on each of n's items and taking d_last back off covers the hops.
 3. Client. A session from client c pays RTT(c, first) / 2 + RTT(c, last) / 2. With step 2,
    its fixed cost is at least
        f_c = min_n RTT(c, n) / 2 + min_n (RTT(c, n) / 2 - d_n).
    So each session's time per token is >= f_c + (sum of the costs of its L items).
 4. Assignment. Admission takes a prefix of the client list. For S sessions, the rate
    sum_s 1 / (f_c(s) + g_s) is largest when the groups are the cheapest L items, the next L
    items, ... (sorted partition: its group sums are majorised by no other partition's, and
    1/(f+x) is convex and decreasing) and the smallest f goes with the smallest group sum
    (1/(f+x) is supermodular: rearrangement). Adding a client never lowers the sum, so S is
    the most sessions the items allow (capped by the clients).
 5. Compute: node n never runs more than slots / t_n(slots) layer-tokens per second, so
    tokens/s <= sum over nodes of that / L.
The bound is the smaller of 4 and 5. What it still ignores: the embedding and the LM head
(Petals' client runs them), contiguous ranges that must chain, hops across regions beyond
the nearest node, and the batch that neighbours on a route impose on each other.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .regions import Site, rtt_ms
from .swarm import Swarm, handoff_s, layer_capacity, layer_time_s


def upper_bound_tokens_per_s(swarm: Swarm, clients: Sequence[Site]) -> float:
    model, params = swarm.model, swarm.params
    n_layers, slots = model.num_layers, params.slots
    nodes = [n for n in swarm.nodes.values() if layer_capacity(n, model, params) > 0]
    if not nodes or not clients:
        return 0.0
    caps = np.array([layer_capacity(n, model, params) for n in nodes])
    if caps.sum() < n_layers:
        return 0.0

    idx = [swarm.index[n.node_id] for n in nodes]
    rtt = swarm.rtt_ms[np.ix_(idx, idx)] / 1000.0
    if len(nodes) > 1:
        nearest = np.where(np.eye(len(nodes), dtype=bool), np.inf, rtt).min(axis=1)
    else:
        nearest = np.zeros(1)  # one node: a session never hops

    costs: list[np.ndarray] = []
    for i, node in enumerate(nodes):
        for batch in range(1, slots + 1):
            hop = nearest[i] / 2 + handoff_s(node, model, batch) if len(nodes) > 1 else 0.0
            item = layer_time_s(node, model, params, batch) + hop / caps[i]
            costs.append(np.full(int(caps[i]), item))
    items = np.sort(np.concatenate(costs))
    sessions = min(len(items) // n_layers, len(clients))
    groups = items[: sessions * n_layers].reshape(sessions, n_layers).sum(axis=1)

    leave = np.array(
        [nearest[i] / 2 + handoff_s(n, model, 1) for i, n in enumerate(nodes)]
        if len(nodes) > 1
        else [0.0]
    )
    floors = []
    for client in clients[:sessions]:
        to_node = np.array([rtt_ms(client, n.site) for n in nodes]) / 1000.0
        floors.append(to_node.min() / 2 + (to_node / 2 - leave).min())
    floors_sorted = np.sort(np.array(floors))
    totals = floors_sorted + groups  # both ascending: rearrangement
    assert (totals > 0).all(), "a session's time per token must be positive"
    kv_bound = float((1.0 / totals).sum())

    ts = np.array([layer_time_s(n, model, params, slots) for n in nodes])
    compute_bound = float((slots / ts).sum()) / n_layers
    return min(kv_bound, compute_bound)
