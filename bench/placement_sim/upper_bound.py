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
        f_c = min_n RTT(c, n) / 2 + min_n (RTT(c, n) / 2 - d_n) + h,
    where h is the cheaper of the LM head on the client's CPU and on the fastest node at
    batch 1 (every token goes through the head somewhere).
    So each session's time per token is >= f_c + (sum of the costs of its L items).
 4. Count. A session visits a set of nodes whose capacities add up to >= L and takes one
    slot on each, so the number of sessions is at most the optimum of the configuration
    LP (bin covering, fractional): max sum_c x_c over multisets c of node capacities that
    cover L, with sum_c x_c * (nodes of capacity k in c) <= slots * (nodes of capacity k).
    Solved exactly by column generation (the pricing problem is an unbounded covering
    knapsack over capacities, no more nodes of a capacity than exist, a DP over 0..L).
 5. Assignment. Admission takes a prefix of the client list. For S sessions, the rate
    sum_s 1 / (f_c(s) + g_s) is largest when the groups are the cheapest L items, the next L
    items, ... (sorted partition: its group sums are majorised by no other partition's, and
    1/(f+x) is convex and decreasing) and the smallest f goes with the smallest group sum
    (1/(f+x) is supermodular: rearrangement). Adding a client never lowers the sum, so S is
    the most sessions the items allow (capped by the clients).
 6. Compute: node n never runs more than slots / t_n(slots) layer-tokens per second, so
    tokens/s <= sum over nodes of that / L.
The bound is the smaller of 5 (S: the least of 1's items / L, 4 and the client count) and
6. What it still ignores: the memory of the embedding and the LM head, that
ranges must be contiguous and chain, hops across regions beyond the nearest node, and
that the sessions 5 forms from the cheapest items need not fit the count 4 allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .regions import Site, rtt_ms
from .swarm import (
    Swarm,
    client_head_time_s,
    handoff_s,
    head_time_s,
    layer_capacity,
    layer_time_s,
)


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
    sessions = min(len(items) // n_layers, len(clients), max_sessions(caps, slots, n_layers))
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
    # Every session's token also goes through the LM head, on its last node's GPU or on
    # the client's CPU: at least the cheapest of those at batch 1.
    head = min(
        client_head_time_s(model, params), min(head_time_s(n, model, params, 1) for n in nodes)
    )
    floors_sorted = np.sort(np.array(floors)) + head
    totals = floors_sorted + groups  # both ascending: rearrangement
    assert (totals > 0).all(), "a session's time per token must be positive"
    kv_bound = float((1.0 / totals).sum())

    ts = np.array([layer_time_s(n, model, params, slots) for n in nodes])
    compute_bound = float((slots / ts).sum()) / n_layers
    return min(kv_bound, compute_bound)


def max_sessions(caps: Sequence[int] | np.ndarray, slots: int, n_layers: int) -> int:
    """Most sessions that nodes of these layer capacities can carry (step 4): the floor of
    the configuration LP's optimum, by column generation."""
    kinds = sorted({min(int(c), n_layers) for c in caps if c > 0}, reverse=True)
    if not kinds:
        return 0
    counts = [sum(1 for c in caps if min(int(c), n_layers) == k) for k in kinds]
    supply = np.array([slots * n for n in counts], dtype=float)
    # Start from the empty LP (x = 0, duals 0); pricing adds the columns that matter.
    columns: list[np.ndarray] = []
    value, duals = 0.0, np.zeros(len(kinds))
    for _ in range(1000):
        if columns:
            value, duals = lp_max(np.array(columns).T, supply)
        column = _cheapest_cover(kinds, counts, duals, n_layers)
        if column is None:
            return int(math.floor(value + 1e-6))
        columns.append(column)
    raise RuntimeError("column generation did not converge")


def _cheapest_cover(
    kinds: list[int], counts: list[int], prices: np.ndarray, n_layers: int
) -> np.ndarray | None:
    """A multiset of capacities covering n_layers, at most counts[i] of kind i (a session
    visits distinct nodes), whose prices add up to less than 1: a column that would raise
    the LP. None when there is none. Bounded covering knapsack, a DP over layers."""
    best = np.full(n_layers + 1, np.inf)  # best[l]: cheapest multiset covering >= l layers
    best[0] = 0.0
    choices: list[np.ndarray] = []
    for i, k in enumerate(kinds):
        new = best.copy()
        took = np.zeros(n_layers + 1, dtype=np.int64)
        for copies in range(1, min(counts[i], -(-n_layers // k)) + 1):
            for need in range(1, n_layers + 1):
                cost = best[max(0, need - copies * k)] + copies * prices[i]
                if cost < new[need]:
                    new[need], took[need] = cost, copies
        best = new
        choices.append(took)
    if best[n_layers] >= 1.0 - 1e-9:
        return None
    column = np.zeros(len(kinds))
    need = n_layers
    for i in range(len(kinds) - 1, -1, -1):
        column[i] = choices[i][need]
        need = max(0, need - int(column[i]) * kinds[i])
    return column


def lp_max(a: np.ndarray, b: np.ndarray) -> tuple[float, np.ndarray]:
    """max sum(x) s.t. a @ x <= b, x >= 0 (b >= 0): dense tableau simplex, Bland's rule.
    Returns the optimum and the duals of the rows. Small problems only (a few rows)."""
    rows, cols = a.shape
    table = np.zeros((rows + 1, cols + rows + 1))
    table[:rows, :cols] = a
    table[:rows, cols : cols + rows] = np.eye(rows)
    table[:rows, -1] = b
    table[-1, :cols] = -1.0
    basis = list(range(cols, cols + rows))
    eps = 1e-12
    for _ in range(10_000):
        entering = next((j for j in range(cols + rows) if table[-1, j] < -1e-12), None)
        if entering is None:
            return float(table[-1, -1]), table[-1, cols : cols + rows].copy()
        ratios = [
            (table[i, -1] / table[i, entering], basis[i], i)
            for i in range(rows)
            if table[i, entering] > eps
        ]
        if not ratios:
            raise ValueError("unbounded LP")
        _, _, row = min(ratios)
        table[row] /= table[row, entering]
        for i in range(rows + 1):
            if i != row and table[i, entering] != 0.0:
                table[i] -= table[i, entering] * table[row]
        basis[row] = entering
    raise RuntimeError("simplex did not converge")
