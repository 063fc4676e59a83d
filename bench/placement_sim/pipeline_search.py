"""A reference from below: the best plan of whole pipelines a local search finds when it
knows this bench's performance model exactly.

The upper bound (`upper_bound.py`) says what no placement can serve more than; it relaxes
a lot on the way (which layers a node holds, which sessions share a batch), so how far
it is from the best real plan is unknown. This search gives the other side: a real plan,
served by Tessera's router like Tessera's own, so the best plan lies between the two.
When Tessera is close to this reference and both are far from the bound, the gap is
mostly the bound's relaxation, not the planner.

What the search knows that the planner does not: the exact cost of a pipeline in
`swarm.py`'s model (the roofline layer time at a full batch, each member's upload at that
batch, the RTT between the two members of every hop, the client's legs). What it ignores
that the planner weighs: how likely each node is to leave (the planner's availability
term), and plan time.

A plan here is a set of disjoint pipelines, each a set of nodes. `chain` turns a set into
a pipeline: the member that loses the fewest layers to the embedding goes first, the
slowest uploader (or the one that loses the fewest to the LM head) last, since the last
member hands nothing on; the rest grouped by region between them; every member gets one
layer, then the fastest members take as many more as they hold. A pipeline is worth
`slots / time per token` (each member serves `slots` sessions at a full batch). The search
starts from a given plan (Tessera's) and climbs, in a fixed pseudo-random order, with four
moves until none raises the total or `max_passes` run out:

- two members of two pipelines trade places;
- a member moves to another pipeline (which then holds it in the middle or at an end);
- a member leaves its pipeline for the spares;
- a spare replaces a member of a pipeline, or joins one.

Then, `KICKS` times, it dissolves two pipelines at random, regroups their nodes and the
spares into new pipelines (`_regroup`), climbs again and keeps the result if it is worth
more (iterated local search): a climb alone cannot pack the leftovers of two regions into
one more pipeline. Every plan it keeps covers all layers in each pipeline, each member
within its memory.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from coordinator.planner import ModelPlan, Shard

from .regions import Site
from .serving import Served, saturate
from .swarm import Hop, Swarm, handoff_s, layer_time_s, session_latency_s
from .tessera import TesseraSystem

MAX_PASSES = 20
KICKS = 10


@dataclass(frozen=True)
class Member:
    node_id: str
    region: str
    mid: int  # layers the node holds alone
    first: int  # next to the embedding
    last: int  # next to the LM head
    both: int  # next to both
    layer_s: float  # one layer at a full batch
    send_s: float  # the full batch's hand-off


def members_of(swarm: Swarm) -> dict[str, Member]:
    """Every node with room for a layer, as the search sees it (a full batch everywhere)."""
    model, params = swarm.model, swarm.params
    embed, head = model.embed_params * 2, model.head_params * 2
    out = {}
    for nid, node in swarm.nodes.items():
        mid = swarm.capacity(nid)
        if mid < 1:
            continue
        out[nid] = Member(
            nid,
            node.site.region,
            mid,
            swarm.capacity(nid, embed),
            swarm.capacity(nid, head),
            swarm.capacity(nid, embed + head),
            layer_time_s(node, model, params, params.slots),
            handoff_s(node, model, params.slots),
        )
    return out


def _end_pairs(group: Sequence[Member]) -> set[tuple[int, int]]:
    """(first, last) candidates: the fewest layers lost to the embedding and to the head,
    and the slowest uploader last."""
    n = len(group)
    by_first = sorted(range(n), key=lambda i: (group[i].mid - group[i].first, i))[:2]
    by_last = sorted(range(n), key=lambda i: (group[i].mid - group[i].last, i))[:2]
    slowest = max(range(n), key=lambda i: (group[i].send_s, -i))
    pairs = set()
    for f in by_first:
        for last in [*by_last, slowest]:
            if f != last:
                pairs.add((f, last))
    return pairs


def _layers(order: Sequence[Member], num_layers: int) -> list[int] | None:
    """Layers per member in chain order: one each, then fastest first up to its room;
    None when they do not cover the model or a member gets none."""
    caps = [c.mid for c in order]
    caps[0], caps[-1] = order[0].first, order[-1].last
    if min(caps) < 1 or sum(caps) < num_layers or len(order) > num_layers:
        return None
    sizes = [1] * len(order)
    left = num_layers - len(order)
    for i in sorted(range(len(order)), key=lambda i: (order[i].layer_s, order[i].node_id)):
        take = min(caps[i] - 1, left)
        sizes[i] += take
        left -= take
    return sizes if left == 0 else None


class PipelineSearch:
    """How the search sees a swarm: its nodes with room for a layer, and what any set of
    them is worth as one pipeline (cached: the moves value the same sets again and again)."""

    def __init__(self, swarm: Swarm, clients: Sequence[Site]) -> None:
        self.swarm = swarm
        self.members = members_of(swarm)
        self.slots = swarm.params.slots
        # The client of a pipeline's sessions, for its two legs: one from its first region.
        self.clients: dict[str, Site] = {}
        for client in clients:
            self.clients.setdefault(client.region, client)
        self.fallback = clients[0] if clients else None
        self._values: dict[frozenset[str], tuple[float, list[Hop]] | None] = {}

    def chain(self, node_ids: Iterable[str]) -> tuple[float, list[Hop]] | None:
        """(time per token at a full batch, hops) of the best ordering tried, or None when
        the nodes cannot make one pipeline in which each holds a layer."""
        key = frozenset(node_ids)
        if key in self._values:
            return self._values[key]
        group = sorted((self.members[nid] for nid in key), key=lambda c: c.node_id)
        best: tuple[float, list[Hop]] | None = None
        num_layers = self.swarm.model.num_layers
        if len(group) == 1:
            candidates = [[group[0]]] if group[0].both >= num_layers else []
        else:
            candidates = []
            for f, last in sorted(_end_pairs(group)):
                start, end = group[f].region, group[last].region
                middle = sorted(
                    (c for i, c in enumerate(group) if i not in (f, last)),
                    key=lambda c: (c.region != start, c.region == end, c.region, c.node_id),
                )
                candidates.append([group[f], *middle, group[last]])
        for order in candidates:
            if len(order) == 1:
                sizes: list[int] | None = [num_layers]
            else:
                sizes = _layers(order, num_layers)
            if sizes is None:
                continue
            hops, a = [], 0
            for c, k in zip(order, sizes, strict=True):
                hops.append(Hop(c.node_id, a, a + k))
                a += k
            seconds = self._seconds(hops)
            if best is None or seconds < best[0]:
                best = (seconds, hops)
        self._values[key] = best
        return best

    def _seconds(self, hops: list[Hop]) -> float:
        first_region = self.members[hops[0].node_id].region
        client = self.clients.get(first_region, self.fallback)
        assert client is not None
        load = {h.node_id: self.slots for h in hops}
        return session_latency_s(self.swarm, client, hops, load)

    def value(self, node_ids: Iterable[str]) -> float | None:
        """A pipeline's tokens/s with every member's slots in use; None: not a pipeline."""
        found = self.chain(node_ids)
        return None if found is None else self.slots / found[0]


def _climb(
    state: PipelineSearch,
    pipes: list[list[str]],
    spares: list[str],
    rng: random.Random,
    max_passes: int,
) -> tuple[list[list[str]], list[str], list[float]]:
    values: list[float] = [state.value(p) or 0.0 for p in pipes]

    def better(new: Sequence[float | None], old: Sequence[float]) -> bool:
        return all(v is not None for v in new) and sum(new) > sum(old) * (1 + 1e-12)  # type: ignore[arg-type]

    for _ in range(max_passes):
        improved = False
        # Two members of two pipelines trade places.
        pairs = [
            (p, i, q, j)
            for p in range(len(pipes))
            for q in range(p + 1, len(pipes))
            for i in range(len(pipes[p]))
            for j in range(len(pipes[q]))
        ]
        rng.shuffle(pairs)
        for p, i, q, j in pairs:
            if i >= len(pipes[p]) or j >= len(pipes[q]):
                continue
            mp, mq = list(pipes[p]), list(pipes[q])
            mp[i], mq[j] = mq[j], mp[i]
            vp, vq = state.value(mp), state.value(mq)
            if better([vp, vq], [values[p], values[q]]):
                pipes[p], pipes[q], values[p], values[q] = mp, mq, vp, vq  # type: ignore[assignment]
                improved = True
        # A member moves to another pipeline, or to the spares.
        for p in rng.sample(range(len(pipes)), len(pipes)):
            for i in range(len(pipes[p]) - 1, -1, -1):
                rest = pipes[p][:i] + pipes[p][i + 1 :]
                vp = state.value(rest) if rest else None
                if vp is None:
                    continue
                moved = pipes[p][i]
                if better([vp], [values[p]]):
                    pipes[p], values[p] = rest, vp
                    spares.append(moved)
                    improved = True
                    continue
                for q in range(len(pipes)):
                    vq = state.value([*pipes[q], moved]) if q != p else None
                    if better([vp, vq], [values[p], values[q]]):
                        pipes[q], values[q] = [*pipes[q], moved], vq  # type: ignore[assignment]
                        pipes[p], values[p] = rest, vp
                        improved = True
                        break
        # A spare replaces a member, or joins a pipeline: the best such move for each.
        for k, spare in enumerate(list(spares)):
            best: tuple[float, int, int | None, float] | None = None
            for p in range(len(pipes)):
                options: list[tuple[int | None, list[str]]] = [(None, [*pipes[p], spare])]
                for i in range(len(pipes[p])):
                    options.append((i, [*pipes[p][:i], spare, *pipes[p][i + 1 :]]))
                for i, trial in options:
                    v = state.value(trial)
                    if v is not None and v > values[p] * (1 + 1e-12):
                        if best is None or v - values[p] > best[0]:
                            best = (v - values[p], p, i, v)
            if best is not None:
                _, p, i, v = best
                if i is None:
                    pipes[p] = [*pipes[p], spare]
                    spares[k] = ""
                else:
                    spares[k] = pipes[p][i]
                    pipes[p] = [*pipes[p][:i], spare, *pipes[p][i + 1 :]]
                values[p] = v
                improved = True
        spares = [s for s in spares if s]
        if not improved:
            break
    return pipes, spares, values


def _regroup(state: PipelineSearch, pool: list[str]) -> tuple[list[list[str]], list[str]]:
    """New pipelines from a pool of nodes, best first: per region, then across regions,
    members added in order of what a layer costs on them (compute plus hand-off spread
    over their layers) until they make a pipeline."""
    pipes: list[list[str]] = []

    def cost(nid: str) -> tuple[float, str]:
        m = state.members[nid]
        return m.layer_s + m.send_s / m.mid, nid

    by_region: dict[str, list[str]] = {}
    for nid in pool:
        by_region.setdefault(state.members[nid].region, []).append(nid)
    groups = [sorted(g, key=cost) for _, g in sorted(by_region.items())]
    left: list[str] = []
    for group in [*groups, None]:
        if group is None:
            group = sorted(left, key=cost)
            left = []
        batch: list[str] = []
        for nid in group:
            batch.append(nid)
            if state.value(batch) is not None:
                pipes.append(batch)
                batch = []
        left += batch
    return pipes, left


def search(
    swarm: Swarm,
    clients: Sequence[Site],
    pipelines: Sequence[Sequence[str]],
    *,
    seed: int = 0,
    max_passes: int = MAX_PASSES,
    kicks: int = KICKS,
) -> tuple[list[list[Hop]], float]:
    """Climb from `pipelines` (node ids; nodes in none of them are spares), then kick
    `kicks` times: dissolve two pipelines at random, regroup their nodes and the spares,
    climb again, keep the result if it is worth more (iterated local search). Returns the
    pipelines found, as hops, and their total value (sum of slots / time per token)."""
    state = PipelineSearch(swarm, clients)
    pipes = [
        list(p)
        for p in pipelines
        if all(nid in state.members for nid in p) and state.value(p) is not None
    ]
    placed = {nid for p in pipes for nid in p}
    spares = sorted(nid for nid in state.members if nid not in placed)
    rng = random.Random(seed)
    pipes, spares, values = _climb(state, pipes, spares, rng, max_passes)
    best = (sum(values), pipes, spares)
    for _ in range(kicks if len(best[1]) >= 2 else 0):
        pipes = [list(p) for p in best[1]]
        pool = list(best[2])
        for k in sorted(rng.sample(range(len(pipes)), 2), reverse=True):
            pool += pipes.pop(k)
        made, left = _regroup(state, pool)
        pipes, spares, values = _climb(state, pipes + made, left, rng, max_passes)
        if sum(values) > best[0] * (1 + 1e-12):
            best = (sum(values), pipes, spares)
    chains = []
    for p in best[1]:
        found = state.chain(p)
        assert found is not None  # every kept pipeline was valued
        chains.append(found[1])
    return chains, best[0]


def searched_served(swarm: Swarm, clients: Sequence[Site], seed: int = 0) -> Served:
    """Served tokens/s of the plan the search finds from Tessera's (r=2) pipelines, served
    by Tessera's router. A node in no pipeline keeps the shard Tessera's plan gave it (a
    replica the router may mix in, as in Tessera's plan)."""
    system = TesseraSystem(swarm, replicas=2, name="best found")
    system.start()
    assert system.plan is not None
    chains, _ = search(swarm, clients, system.plan.pipelines, seed=seed)
    found = ModelPlan(system.spec.name, [0, swarm.model.num_layers], dict(system.plan.holders))
    for hops in chains:
        for h in hops:
            found.holders[h.node_id] = Shard(system.spec.name, h.start, h.end)
        found.pipelines.append(tuple(h.node_id for h in hops))
    system.plan = found
    return saturate(system, clients)
