"""An upper bound on served tokens/s that no placement or router can beat in this model.

Relax everything a placement and a router decide, keep only what the hardware and the
network impose, and bound what is left. The argument, step by step (README.md repeats it):

 1. Items. A session that passes node n takes one of its `slots` KV slots and runs there
    k <= cap_n layers (cap_n: layers n's memory holds with nothing else on it; every node
    holds one contiguous range). When n serves b sessions, number them 1..b: session j
    pays t_n(b) >= t_n(j) per layer. So node n offers `slots` chunks of cap_n items, the
    j-th costing t_n(j) per item, and each chunk serves one session: any feasible set of
    sessions maps onto items that cost no more than the compute the sessions really pay.
 2. Hops. A hop out of node n (to a different node) costs at least
    d_n(j) = min over m != n of RTT(n, m) / 2 + hand-off(n, j) for its session j (the
    hand-off is at the node's batch b >= j). A session leaves every node it visits but
    the last. Because k <= cap_n, d_n >= d_n * k / cap_n, so charging each item of chunk j
    a share s_n(j) / cap_n with s_n(j) <= d_n(j) covers the hops, once the last node's
    share (at most s_last(j)) is taken back as a credit (step 3).
 3. Client. A session from client c pays RTT(c, first) / 2 + RTT(c, last) / 2 and the LM
    head h (the cheaper of the client's CPU and the fastest node at batch 1). Its last
    leg minus its credit is at least RTT(c, nearest) / 2 - kappa, with
    kappa[n, j] = s_n(j) - min over admissible clients c of (RTT(c, n) - RTT(c, nearest)) / 2.
    So a session's time per token is >= 2 x RTT(c, nearest) / 2 + h + (its L items) - its
    credit, and the credits of different sessions are different chunks' (a chunk serves one
    session). Five ways to charge, each valid; the bound is the least of them:
      (a) s_n = d_n(1) in every chunk, and every session takes the largest credit its own
          client could see: floor f_c = min_n RTT(c, n) / 2 + min_n (RTT(c, n) / 2 - d_n(1)).
      (b) s_n(j) = d_n(min(j, J)) - delta for J = 1..slots and delta in {0, min_n d_n(1)},
          the `sessions` largest credits kappa (one per chunk), and delta for each hop a
          session must make (below).
      (c) No shares, no credits: only hops, each out of a distinct node, so a session on k
          nodes pays at least the k - 1 smallest d_n(1).
      (d) As (c), but hops are items too, priced at the margin of the node's batch: a node
          whose b sessions include m that leave it pushes b hidden states per step, so
          those m hops cost m x (b x u_n) >= m^2 x u_n (u_n: one session's hand-off) plus
          m x RTT to its nearest peer / 2. Node n offers `slots` hop items, the j-th at
          nearest_n / 2 + (2j - 1) u_n, and any m of its hops cost at least its m cheapest
          items (they add up to m^2 u_n + m nearest_n / 2). A session on k distinct nodes
          leaves k - 1 of them at least once (one item each, so a node spends at most one
          per session), and the sessions, fewest hops first, take the cheapest items in
          turn: any k real sessions make at least the k smallest hop counts and pay at
          least that many of the cheapest items. Without it a busy slow uploader's hand-off
          was charged as if it carried one session: at 70B a batch of 8 on a cable line is
          50 ms a hop, not 7.
      (e) Every part together in one linear program (joint_bound.py): its sessions take
          their layers, hops and client legs from the same nodes, and stay in the regions
          they touch, paying the backbone to reach them and between them. It binds on
          every full benchmark scenario; (d) still does on some small swarms.
    Hops per session: a session on k nodes hops k - 1 times, and one of its k nodes holds
    >= L / k of its layers, so at most slots x #(cap_n >= ceil(L / k)) sessions visit k
    nodes or fewer: the i-th session (fewest hops first) hops at least as often as the
    smallest k that leaves room for i + 1 sessions, minus 1. Ways (b) and (d) only add
    hops up, so they also use a count of all k sessions together: their visited slots
    cover k x L layers, so they visit at least as many nodes as the fewest slots, largest
    capacities first, that cover k x L (on 70b-global 1,274 visits for 113 sessions, where
    the per-session count allows 791).
    (An earlier version charged d_n(j) in chunk j but took back only d_n(1): a session
    ending in chunk 4 of a slow uploader was charged a hand-off it never pays, and on
    small swarms of 24 GB cards the bound fell 1-3 % below what Tessera and Parallax serve.)
 4. Count. A session visits a set of nodes whose capacities add up to >= L and takes one
    slot on each, so the number of sessions is at most the optimum of the configuration
    LP (bin covering, fractional): max sum_c x_c over multisets c of node capacities that
    cover L, with sum_c x_c * (nodes of capacity k in c) <= slots * (nodes of capacity k).
    Solved exactly by column generation (the pricing problem is an unbounded covering
    knapsack over capacities, no more nodes of a capacity than exist, a DP over 0..L).
 5. Assignment. Admission takes a prefix of the client list, so the served clients are
    among the first S (S: the least of the items / L, step 4 and the client count). A
    session's time is >= f + g + o - kappa: its client's floor, its items, its hop floor
    and minus its credit. Sort the floors, the groups (cheapest L items, next L, ...), the
    hop floors ascending and the credits descending, and add them up term by term: for
    every k, the k smallest of these sums add up to no more than any k real sessions'
    lower bounds (each of the four parts is at least its k smallest, resp. at most its k
    largest). 1 / x is convex and decreasing, so the real sum of 1 / time is at most the
    sum over these sorted totals (weak majorisation; fewer real sessions only drop
    positive terms). A way of charging whose smallest total is not positive proves
    nothing (with 8 slots, batch-8 hand-offs give credits that large) and is left out.
 6. Compute: node n never runs more than slots / t_n(slots) layer-tokens per second, so
    tokens/s <= sum over nodes of that / L.
The bound is the smaller of 5 and 6. What it still ignores: the memory of the embedding
(a client can look its tokens up itself), that ranges must be contiguous and chain, and
that sessions and nodes' states come whole (the LP of way (e) splits them into fractions,
though it counts whole visits and the LM head's memory; way (d) prices a node's hand-offs
at the margin of its batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .joint_bound import SessionsLP, joint_bound_tokens_per_s, tiered_bound_tokens_per_s
from .models import ModelShape
from .regions import Site, rtt_ms
from .swarm import (
    ServingParams,
    SimNode,
    Swarm,
    client_head_time_s,
    handoff_s,
    head_time_s,
    layer_capacity,
    layer_time_s,
    nearest_peer_s,
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
    nearest = nearest_peer_s(rtt)

    # leave[n, j-1] = d_n at batch j (step 2): RTT to n's nearest peer / 2 + hand-off.
    leave = np.zeros((len(nodes), slots))
    if len(nodes) > 1:
        for i, n in enumerate(nodes):
            for j in range(1, slots + 1):
                leave[i, j - 1] = nearest[i] / 2 + handoff_s(n, model, j)
    sessions = min(
        int(caps.sum()) * slots // n_layers, len(clients), max_sessions(caps, slots, n_layers)
    )

    # Step 3: client legs. to_node[c, n] = RTT(c, n) / 2 for the clients admission can take.
    to_node = np.array([[rtt_ms(c, n.site) for n in nodes] for c in clients[:sessions]]) / 2e3
    nearest_leg = to_node.min(axis=1)
    # Every session's token also goes through the LM head, on its last node's GPU or on
    # the client's CPU: at least the cheapest of those at batch 1.
    head = min(
        client_head_time_s(model, params), min(head_time_s(n, model, params, 1) for n in nodes)
    )
    # Five valid ways of charging (step 3), (a)-(c) taking d_last back; the least binds.
    # Credit kappa[n, j]: what a session ending on n in chunk j gets back at most, over
    # every client admission can take (its last leg beyond the nearest node's pays part).
    kappa = leave - (to_node - nearest_leg[:, None]).min(axis=0)[:, None]
    groups_1 = _groups(nodes, caps, params, model, leave[:, [0] * slots], sessions)
    # (a) Every chunk carries d_n at batch 1; every session takes back the largest d_last
    # its own client could see.
    shared = _rate_of_sorted(
        np.sort(nearest_leg + (to_node - leave[:, 0]).min(axis=1) + head) + groups_1
    )
    # (b) Chunk j carries d_n at batch min(j, cap_batch) (a hand-off at a batch no larger
    # than the node's load) less a base hop delta that every hop costs at least; only the
    # one session in that chunk can end on n with it, taking back kappa[n, min(j,
    # cap_batch)] - delta, and a session pays delta for each of its hops, whose count
    # `hop_increments` bounds from below (a session on k nodes hops k - 1 times). The largest
    # credits go to the cheapest sessions (step 5). cap_batch = 1 charges every chunk the
    # batch-1 hop; larger ones charge busy uploaders more but hand out larger credits;
    # delta = 0 or the smallest d_n. Each is valid: take the least.
    floor_2 = np.sort(2 * nearest_leg + head)
    variants = []
    for delta in (0.0, float(leave[:, 0].min())):
        hops = delta * hop_increments(caps, slots, n_layers, sessions)
        for cap_batch in range(1, slots + 1):
            batches = np.minimum(np.arange(slots), cap_batch - 1)
            shares = leave[:, batches] - delta
            groups = _groups(nodes, caps, params, model, shares, sessions)
            credits = _largest(kappa[:, batches] - delta, sessions)
            variants.append(_rate_of_sorted(floor_2 + groups - credits + hops))
    # (c) No hop shares at all: only the count of hops, each out of a distinct node, so at
    # least the k - 1 smallest d_n at batch 1; nothing to take back.
    hops = _hop_floors(caps, np.sort(leave[:, 0]), slots, n_layers, sessions)
    zero_share = np.zeros((len(nodes), slots))
    unshared = floor_2 + _groups(nodes, caps, params, model, zero_share, sessions)
    variants.append(_rate_of_sorted(unshared + hops))
    # (d) As (c), with each node's hops priced at the margin of its batch.
    if len(nodes) > 1:
        unit = np.array([handoff_s(n, model, 1) for n in nodes])
        margins = 2 * np.arange(1, slots + 1) - 1
        hop_items = nearest[:, None] / 2 + margins[None, :] * unit[:, None]
        counts = hop_increments(caps, slots, n_layers, sessions)
        variants.append(_rate_of_sorted(unshared + _batched_hop_floors(hop_items, counts)))
    # (e) Every part of a session priced together, by region (joint_bound.py).
    joint = SessionsLP(swarm, clients[:sessions])
    variants.append(joint_bound_tokens_per_s(joint))
    # (f) As (e), with every session in one placement at once (joint_bound.py).
    variants.append(tiered_bound_tokens_per_s(joint))
    kv_bound = min(shared, *variants)

    ts = np.array([layer_time_s(n, model, params, slots) for n in nodes])
    compute_bound = float((slots / ts).sum()) / n_layers
    return min(kv_bound, compute_bound)


def _groups(
    nodes: Sequence[SimNode],
    caps: np.ndarray,
    params: ServingParams,
    model: ModelShape,
    leave: np.ndarray,
    sessions: int,
) -> np.ndarray:
    """Steps 1, 2 and 5: the cost of the cheapest L items, of the next L, ... for `sessions`
    sessions (ascending). Chunk j of node n holds cap_n items, each costing the layer time
    at batch j plus leave[n, j-1] / cap_n (its share of the hop out of n)."""
    n_layers = model.num_layers
    costs = [
        np.full(int(caps[i]), layer_time_s(node, model, params, j + 1) + leave[i, j] / caps[i])
        for i, node in enumerate(nodes)
        for j in range(leave.shape[1])
    ]
    items = np.sort(np.concatenate(costs))
    return items[: sessions * n_layers].reshape(sessions, n_layers).sum(axis=1)


def _hop_counts(caps: np.ndarray, slots: int, n_layers: int, sessions: int) -> np.ndarray:
    """The fewest hops each session makes, ascending (step 3, hops per session).

    Sessions that visit at most k nodes number at most slots x #(cap >= ceil(L / k)); the
    i-th fewest-hops session therefore visits at least the least k that allows i + 1 of
    them, and hops k - 1 times (0 where no k allows it: nothing is claimed)."""
    counts = np.zeros(sessions, dtype=np.int64)
    i = 0
    for k in range(1, len(caps) + 1):
        allowed = slots * int((caps >= -(-n_layers // k)).sum())
        if allowed > i:
            end = min(sessions, allowed)
            counts[i:end] = k - 1
            i = end
        if i >= sessions:
            break
    return counts


def hop_increments(caps: np.ndarray, slots: int, n_layers: int, sessions: int) -> np.ndarray:
    """Hop floors whose running sums bound the hops of any k sessions together (ways (b)
    and (d), which only add hops up; ascending order is not promised).

    Two counts of the node visits k sessions make, each valid, the larger taken: the k
    smallest per-session floors of `_hop_counts` (+ 1 visit each), and the fewest KV slots
    whose capacities cover k x L layers (each session's visited slots cover L, a slot
    being one of a node's `slots`, worth cap_n layers): taken from the largest
    capacities down. A session on v distinct nodes leaves v - 1 of them."""
    ks = np.arange(1, sessions + 1)
    by_rank = np.cumsum(_hop_counts(caps, slots, n_layers, sessions) + 1)
    covered = np.cumsum(np.sort(np.repeat(np.minimum(caps, n_layers), slots))[::-1])
    by_layers = np.searchsorted(covered, n_layers * ks) + 1
    hops = np.maximum(by_rank, by_layers) - ks
    return np.diff(hops, prepend=0)


def _hop_floors(
    caps: np.ndarray, smallest_hops: np.ndarray, slots: int, n_layers: int, sessions: int
) -> np.ndarray:
    """A lower bound on each session's hop time, ascending (steps (b) and (c) above);
    `smallest_hops`: lower bounds of single hops out of distinct nodes, ascending. The
    i-th fewest-hops session pays at least its hop count's smallest hops in the swarm."""
    prefix = np.concatenate([[0.0], np.cumsum(smallest_hops)])
    return prefix[np.minimum(_hop_counts(caps, slots, n_layers, sessions), len(prefix) - 1)]


def _batched_hop_floors(hop_items: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Way (d): sessions, fewest hops first, take the cheapest hop items in turn, one per
    hop; each session's floor is the sum of its items (ascending, as `counts` is)."""
    prefix = np.concatenate([[0.0], np.cumsum(np.sort(hop_items.ravel()))])
    ends = np.minimum(np.cumsum(counts), len(prefix) - 1)
    starts = np.concatenate([[0], ends[:-1]])
    return prefix[ends] - prefix[starts]


def _largest(credits: np.ndarray, count: int) -> np.ndarray:
    """The `count` largest credits, largest first (paired with the cheapest sessions)."""
    return np.sort(credits.ravel())[::-1][:count]


def _rate_of_sorted(totals: np.ndarray) -> float:
    """Sum of 1 / time per token over sessions whose lower bounds are `totals` (step 5).

    A way of charging whose smallest total is not positive bounds nothing (1 / x is convex
    and decreasing only for x > 0; large credits can do that with many slots): infinity.
    Way (c) never credits anything, so the least over the ways stays finite."""
    if not (totals > 0).all():
        return math.inf
    return float((1.0 / totals).sum())


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
