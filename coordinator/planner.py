"""Planner v2: which node holds which contiguous layer range of which model.

A pure function over data (no I/O), so it can be property-tested and benchmarked. The
objective and the algorithm are written up in PLANNER.md next to this file.

With `min_stages == 1` (the default) a model is placed as *pipelines*: disjoint groups of
nodes whose ranges chain to cover [0, L). Every node serves a bounded number of sessions
(its KV cache), so served throughput grows with the number of pipelines; the planner
packs as many as memory allows (bin covering, within a region first), then gives each
pipeline's layers to its fastest members first (decode is memory-bandwidth bound, and a
token's latency is the sum over the chain). Re-planning keeps every surviving shard,
repairs broken pipelines with idle nodes, forms new pipelines from idle ones, and only
switches to a fresh plan when its estimated throughput beats the kept one by `hysteresis`.

With `min_stages > 1` the operator asks for deeper pipelines: the model is cut into one
stage layout (v1) and routes hop at every cut.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# Fraction of a node's usable memory kept free for activations, allocator slack and
# the owner's other programs. Petals' OOM reports (#308, #413) came from packing to 100%.
HEADROOM = 0.10
# A fresh plan replaces the kept one only when its estimated served throughput is this
# much higher: moving weights costs minutes of downloads, and estimates are noisy.
HYSTERESIS = 0.20
# Moving weights pays off only over the time the new layout will last: about a node's
# median session (an hour; see bench/placement_sim/churn.py). A move that takes m seconds
# of downloads must gain enough over the rest of this horizon (see `worth_moving`).
PAYBACK_S = 3600.0
# Download rate assumed for a node that has not reported one (Mb/s).
DEFAULT_DOWNLOAD_MBPS = 100.0
# Estimated cost of one hand-off between two nodes of a pipeline (serialisation plus a
# one-way trip inside a region), and the extra when the pipeline crosses regions. Only
# used to compare plans; the router uses measured RTTs.
HOP_S = 0.02
CROSS_REGION_S = 0.06
# Spare nodes (in no pipeline) replicate the least-covered layers even above the floor:
# routes mix them with pipeline nodes, which adds sessions.
SPARES_REPLICATE = True
# Departures per hour online assumed for a node without history (coordinator/reliability.py
# estimates the others): an exponential lifetime whose median is an hour, as
# bench/placement_sim/churn.py assumes for GPU volunteers.
PRIOR_LEAVE_RATE_PER_H = math.log(2)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    params_per_layer: int
    embed_params: int  # held by the first stage
    head_params: int  # final norm + LM head, held by the last stage
    kv_values_per_token_per_layer: int  # 2 * kv_heads * head_dim
    hidden_size: int = 0  # what one hop sends per token (hidden states); 0 = unknown
    # The latency bound of the objective: a pipeline whose estimated time per token is
    # above it serves nothing the model's users asked for (0 = no bound).
    max_token_latency_s: float = 0.0
    # The price bound, in credit units per 1,000 tokens through every layer: a pipeline
    # dearer than this serves nobody the operator means to sell to (0 = no bound).
    max_token_price: float = 0.0
    # How much it is asked for, e.g. sessions opened lately (placement counts them); when
    # several models share the swarm their pipelines' memory follows demand + 1 each.
    demand: float = 0.0


@dataclass(frozen=True)
class Shard:
    model: str
    start: int
    end: int

    def covers(self, start: int, end: int) -> bool:
        return self.start <= start and end <= self.end

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    usable_bytes: int
    speed: float  # relative compute speed (measured TFLOPS or better)
    dtype_bytes: int = 4  # 4 for fp32 on CPU, 2 for fp16/bf16 on GPU
    kv_tokens: int = 4096  # KV cache budget per shard, in tokens
    mem_bandwidth: float = 0.0  # GB/s; 0 = unknown (layer time from speed alone)
    region: str = ""  # nodes of one region form pipelines together first
    # Measured by the coordinator (coordinator/measurements.py); 0 = not measured yet.
    # compute time per billion parameters and token (decode reads each weight once per
    # token, so this serves every model); beats the roofline
    ms_per_gparam: float = 0.0
    # Measured fixed time of one call, whatever its layers (framework, launches): a member
    # costs it once per token, so it weighs against adding members to a pipeline.
    call_ms: float = 0.0
    rtt_ms: float = 0.0  # typical round trip to the peers it hands off to (median)
    upload_mbps: float = 0.0  # uplink: pushing a token's hidden state to the next hop
    download_mbps: float = 0.0  # fetching weights (0: DEFAULT_DOWNLOAD_MBPS)
    cached: tuple[Shard, ...] = ()  # shards whose weights the node has on disk already
    # How often it leaves: departures per hour online, from its history (0 = no history:
    # PRIOR_LEAVE_RATE_PER_H). A pipeline is down from a member's departure until a
    # replacement has fetched that member's weights (see `availability`).
    leave_rate_per_h: float = 0.0
    price: float = 0.0  # what it asks, credit units per 1,000 token-layers (0 = free)


@dataclass
class ModelPlan:
    model: str
    # Cuts every route hops at: [0, L] for pipeline plans (routes are free to chain any
    # ranges), the stage layout [0, b1, ..., L] when the operator asked for min_stages > 1.
    boundaries: list[int]
    holders: dict[str, Shard] = field(default_factory=dict)  # node_id -> shard
    # Node ids of each full pipeline, in layer order; holders outside them are replicas.
    pipelines: list[tuple[str, ...]] = field(default_factory=list)
    # The memory the model's share of the swarm was sized at (`shares`; 0 = not shared).
    share_bytes: float = 0.0

    def stages(self) -> list[tuple[int, int]]:
        return list(zip(self.boundaries, self.boundaries[1:], strict=False))

    def layer_coverage(self) -> list[int]:
        """Holders per layer."""
        num_layers = self.boundaries[-1]
        delta = [0] * (num_layers + 1)
        for s in self.holders.values():
            delta[max(0, s.start)] += 1
            delta[min(num_layers, s.end)] -= 1
        counts, running = [], 0
        for d in delta[:-1]:
            running += d
            counts.append(running)
        return counts

    def replicas_per_stage(self) -> list[int]:
        """The fewest holders of any layer of each stage."""
        counts = self.layer_coverage()
        return [min(counts[a:b], default=0) for a, b in self.stages()]

    def missing_layers(self) -> list[tuple[int, int]]:
        """Runs of layers nobody holds, split at stage cuts."""
        counts = self.layer_coverage()
        missing: list[tuple[int, int]] = []
        for a, b in self.stages():
            layer = a
            while layer < b:
                if counts[layer]:
                    layer += 1
                    continue
                end = layer
                while end < b and counts[end] == 0:
                    end += 1
                missing.append((layer, end))
                layer = end
        return missing


def weight_bytes(model: ModelSpec, node: NodeSpec, start: int, end: int) -> int:
    """The weights of layers [start, end) (with the embedding or the LM head at the ends),
    in the node's compute dtype."""
    params = (end - start) * model.params_per_layer
    if start == 0:
        params += model.embed_params
    if end == model.num_layers:
        params += model.head_params
    return params * node.dtype_bytes


def shard_bytes(model: ModelSpec, node: NodeSpec, start: int, end: int) -> int:
    """Weights plus the KV cache budget of a shard, in the node's compute dtype."""
    kv = node.kv_tokens * (end - start) * model.kv_values_per_token_per_layer
    return weight_bytes(model, node, start, end) + kv * node.dtype_bytes


def fits(model: ModelSpec, node: NodeSpec, start: int, end: int, used: int = 0) -> bool:
    return used + shard_bytes(model, node, start, end) <= node.usable_bytes * (1 - HEADROOM)


def max_layers(model: ModelSpec, node: NodeSpec, used: int = 0) -> int:
    """How many middle layers fit (pessimistic: counts embeddings and head)."""
    lo, hi = 0, model.num_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits_any_position(model, node, mid, used):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fits_any_position(model: ModelSpec, node: NodeSpec, n: int, used: int) -> bool:
    budget = node.usable_bytes * (1 - HEADROOM) - used
    per_layer = model.params_per_layer + node.kv_tokens * model.kv_values_per_token_per_layer
    worst = n * per_layer + model.embed_params + model.head_params
    return worst * node.dtype_bytes <= budget


def layer_seconds(model: ModelSpec, node: NodeSpec) -> float:
    """Decode time of one layer for one token: measured when the coordinator has enough
    samples, else the roofline of compute and memory bandwidth."""
    if node.ms_per_gparam > 0:
        return node.ms_per_gparam * model.params_per_layer / 1e12
    compute = 2.0 * model.params_per_layer / (max(node.speed, 1e-9) * 1e12)
    if node.mem_bandwidth <= 0:
        return compute
    memory = model.params_per_layer * node.dtype_bytes / (node.mem_bandwidth * 1e9)
    return max(compute, memory)


def plan(
    models: Iterable[ModelSpec],
    nodes: Iterable[NodeSpec],
    previous: Mapping[str, ModelPlan] | None = None,
    *,
    replicas: int = 2,
    min_stages: int = 1,
    hysteresis: float = HYSTERESIS,
) -> dict[str, ModelPlan]:
    """Place every model on the nodes. Models are given in priority order.

    `replicas` is a floor on holders per layer that spare nodes fill when the pipelines
    alone do not reach it. `hysteresis`: a re-plan moves surviving shards only when a fresh
    plan's estimated throughput exceeds the kept plan's by this fraction. Several models
    share the nodes by demand (`shares`); with `min_stages > 1` they are placed one after
    the other, each in the memory the ones before it left.
    """
    previous = previous or {}
    models = list(models)
    node_list = sorted(nodes, key=lambda n: (-n.speed, -n.usable_bytes, n.node_id))
    by_id = {n.node_id: n for n in node_list}
    used: dict[str, int] = {n.node_id: 0 for n in node_list}
    plans: dict[str, ModelPlan] = {}
    parts, targets = (
        shares(models, node_list, previous, hysteresis) if min_stages == 1 else ({}, {})
    )
    for model in models:
        old = previous.get(model.name)
        if min_stages > 1:
            plans[model.name] = _plan_layout(
                model, node_list, by_id, used, old, replicas, min_stages
            )
        else:
            part = parts[model.name]
            plans[model.name] = _plan_pipelines(
                model, part, {n.node_id: n for n in part}, used, old, replicas, hysteresis
            )
            plans[model.name].share_bytes = targets.get(model.name, 0.0)
    return plans


# ---- several models (min_stages == 1) -------------------------------------------------------

# A model gets at least this many copies' worth of memory, when there is room: one full
# pipeline, plus slack for bin covering's waste and the headroom.
FLOOR_COPIES = 1.5


def copy_bytes(model: ModelSpec, nodes: Sequence[NodeSpec]) -> float:
    """Memory one full pipeline of the model takes: every layer with its KV budget, the
    embedding and the head, at the nodes' typical dtype and KV budget."""
    if not nodes:
        return 0.0
    dtype = sorted(n.dtype_bytes for n in nodes)[len(nodes) // 2]
    kv_tokens = sorted(n.kv_tokens for n in nodes)[len(nodes) // 2]
    per_layer = model.params_per_layer + kv_tokens * model.kv_values_per_token_per_layer
    return float(model.num_layers * per_layer + model.embed_params + model.head_params) * dtype


def shares(
    models: Sequence[ModelSpec],
    nodes: Sequence[NodeSpec],
    previous: Mapping[str, ModelPlan],
    hysteresis: float = HYSTERESIS,
) -> tuple[dict[str, list[NodeSpec]], dict[str, float]]:
    """Which nodes form each model's pipelines when several models share the swarm, and
    the memory each model's share is sized at.

    Pipelines of one model serve its sessions only, so placing models one after the other
    lets the first take every node and leaves the others unavailable. Instead each model
    gets a share of the swarm's memory: first a floor (FLOOR_COPIES copies, in priority
    order while there is room), so every model that can be served is; then the rest in
    proportion to (demand + 1) x its copy's bytes, so pipelines follow demand. Nodes keep
    the model they served while its target is within `hysteresis` of the one it was sized
    at before; when the target moved more, whole pipelines while they fit under the new
    target plus `hysteresis`. The others go, largest first, to the model furthest below
    its target. Each node serves one model: its KV slots and compute are not shared.
    Node lists keep the order they came in.
    """
    if len(models) <= 1:  # nothing to share (no model yet, or one)
        return {m.name: list(nodes) for m in models}, {}
    total = float(sum(n.usable_bytes for n in nodes)) * (1 - HEADROOM)
    need = {m.name: copy_bytes(m, nodes) for m in models}
    target: dict[str, float] = {}
    left = total
    for m in models:
        floor = min(left, FLOOR_COPIES * need[m.name])
        target[m.name] = floor
        left -= floor
    weight = {m.name: (max(0.0, m.demand) + 1.0) * need[m.name] for m in models}
    weights = sum(weight.values()) or 1.0
    for name in target:
        target[name] += left * weight[name] / weights
    by_id = {n.node_id: n for n in nodes}
    owner: dict[str, str] = {}
    held = dict.fromkeys(target, 0.0)

    def give(name: str, node_ids: Iterable[str]) -> None:
        for nid in node_ids:
            owner[nid] = name
            held[name] += by_id[nid].usable_bytes * (1 - HEADROOM)

    for m in models:
        old = previous.get(m.name)
        if old is None:
            continue
        piped = {nid for pipe in old.pipelines for nid in pipe}
        groups = [*old.pipelines, *((nid,) for nid in old.holders if nid not in piped)]
        # Nodes come in whole, so a share overshoots its target by up to a node: a target
        # that has not really moved keeps what it has, or a re-plan would shuffle nodes.
        cap = target[m.name] * (1 + hysteresis)
        steady = old.share_bytes > 0 and abs(target[m.name] / old.share_bytes - 1) <= hysteresis
        for group in groups:
            ids = [nid for nid in group if nid in by_id and nid not in owner]
            size = sum(by_id[nid].usable_bytes for nid in ids) * (1 - HEADROOM)
            if ids and (steady or held[m.name] + size <= cap):
                give(m.name, ids)
    rank = {m.name: i for i, m in enumerate(models)}
    for n in sorted(nodes, key=lambda n: (-n.usable_bytes, n.node_id)):
        if n.node_id in owner:
            continue
        name = max(
            target,
            key=lambda t: ((target[t] - held[t]) / max(target[t], 1.0), -rank[t]),
        )
        give(name, [n.node_id])
    parts = {m.name: [n for n in nodes if owner.get(n.node_id) == m.name] for m in models}
    return parts, target


def estimated_tokens_per_s(
    model: ModelSpec, model_plan: ModelPlan, nodes: Mapping[str, NodeSpec]
) -> float:
    """The planner's objective: sum over full pipelines of availability / (time per token).

    Each node serves the same number of sessions (its KV budget), so a pipeline's sessions
    each make 1 / latency tokens per second while it is up; the common factor is left out.
    """
    total = 0.0
    for pipe in model_plan.pipelines:
        members = _pipe_members(model_plan, nodes, pipe)
        if members is not None:
            total += pipeline_value(model, members)
    return total


Member = tuple[NodeSpec, int, int]  # a pipeline member and its layers [start, end)


def _pipe_members(
    model_plan: ModelPlan, nodes: Mapping[str, NodeSpec], pipe: Sequence[str]
) -> list[Member] | None:
    members = []
    for nid in pipe:
        shard = model_plan.holders.get(nid)
        if nid not in nodes or shard is None:
            return None  # a member is gone
        members.append((nodes[nid], shard.start, shard.end))
    return members


def pipeline_seconds(
    model: ModelSpec, model_plan: ModelPlan, nodes: Mapping[str, NodeSpec], pipe: Sequence[str]
) -> float | None:
    """Estimated time per token through one of the plan's pipelines (None: a member is gone)."""
    members = _pipe_members(model_plan, nodes, pipe)
    return None if members is None else _members_seconds(model, members)


def _members_seconds(model: ModelSpec, members: Sequence[Member]) -> float:
    compute = sum((b - a) * layer_seconds(model, n) + n.call_ms / 1e3 for n, a, b in members)
    return compute + network_seconds(model, [n for n, _, _ in members])


def pipeline_value(
    model: ModelSpec, members: Sequence[Member], seconds: float | None = None
) -> float:
    """A pipeline's term of the objective: its expected tokens/s per session slot
    (`seconds`: its time per token, when the caller has it)."""
    if seconds is None:
        seconds = _members_seconds(model, members)
    return pipeline_rate(model, seconds, token_price(members)) * availability(model, members)


def pipeline_rate(model: ModelSpec, seconds: float, price: float = 0.0) -> float:
    """1 / a pipeline's time per token, or nothing when that time breaks the model's
    latency bound or its price per 1,000 tokens the price bound: its sessions would be too
    slow, or too dear, to count."""
    bound = model.max_token_latency_s
    if bound > 0 and seconds > bound:
        return 0.0
    if model.max_token_price > 0 and price > model.max_token_price:
        return 0.0
    return 1.0 / seconds


def token_price(members: Iterable[Member]) -> float:
    """What 1,000 tokens through the pipeline cost: layers x each member's price."""
    return sum((b - a) * node.price for node, a, b in members)


def leave_rate_per_s(node: NodeSpec) -> float:
    return (node.leave_rate_per_h or PRIOR_LEAVE_RATE_PER_H) / 3600.0


def availability(model: ModelSpec, members: Iterable[Member]) -> float:
    """The share of time a pipeline is expected to serve.

    It serves until a member leaves, then is down until a replacement has fetched that
    member's weights (at DEFAULT_DOWNLOAD_MBPS: which node replaces it is not known yet).
    Up and down times alternate, so the share is up / (up + down) = 1 / (1 + sum over
    members of leave rate x repair time). The sum of the members' weights is the model's,
    so with equal leave rates every pipeline of a model has the same availability; it
    decides only between nodes whose histories differ: reliable nodes are worth more
    together, as fast ones are.
    """
    rate = DEFAULT_DOWNLOAD_MBPS * 1e6 / 8
    down = sum(leave_rate_per_s(n) * weight_bytes(model, n, a, b) / rate for n, a, b in members)
    return 1.0 / (1.0 + down)


def handoff_seconds(model: ModelSpec, node: NodeSpec) -> float:
    """Time for `node` to push one token's hidden state out of its uplink (0 if unknown)."""
    if node.upload_mbps <= 0 or model.hidden_size <= 0:
        return 0.0
    return model.hidden_size * node.dtype_bytes * 8 / (node.upload_mbps * 1e6)


def network_seconds(model: ModelSpec, members: Sequence[NodeSpec]) -> float:
    """Estimated network time of one token through a chain, in chain order.

    With measured RTTs: the client's round trip to the ends (about each end's typical RTT,
    halved twice) plus, per hand-off, half the mean of the two nodes' typical RTTs and the
    sender's upload time. Unmeasured nodes count `HOP_S` per hand-off. Crossing regions
    costs `CROSS_REGION_S` per extra region either way (typical RTTs are within a region).
    """
    regions = {n.region for n in members}
    total = (len(regions) - 1) * CROSS_REGION_S
    if not all(n.rtt_ms > 0 for n in members):
        return (
            total
            + (len(members) - 1) * HOP_S
            + sum(handoff_seconds(model, n) for n in members[:-1])
        )
    total += (members[0].rtt_ms + members[-1].rtt_ms) / 2000.0
    for a, b in zip(members, members[1:], strict=False):
        total += (a.rtt_ms + b.rtt_ms) / 4000.0 + handoff_seconds(model, a)
    return total


# ---- pipelines (min_stages == 1) ------------------------------------------------------------


@dataclass(frozen=True)
class _Cand:
    """A node with room for layers: how many fit in each position, and how fast they run."""

    node: NodeSpec
    mid: int  # layers alone
    first: int  # layers next to the embedding
    last: int  # layers next to the LM head
    both: int  # layers next to both
    seconds: float  # per layer and token
    send_s: float  # hand-off of one token's hidden state to the next member
    call_s: float  # fixed time of its call per token, whatever its layers

    @property
    def shape(self) -> tuple[str, int, int, int, int]:
        """Nodes of one shape can swap places in pipelines without changing what fits."""
        return (self.node.region, self.mid, self.first, self.last, self.both)

    @property
    def node_id(self) -> str:
        return self.node.node_id


def _candidate(model: ModelSpec, node: NodeSpec, used: int) -> _Cand | None:
    budget = node.usable_bytes * (1 - HEADROOM) - used
    per_layer = (
        model.params_per_layer + node.kv_tokens * model.kv_values_per_token_per_layer
    ) * node.dtype_bytes
    embed = model.embed_params * node.dtype_bytes
    head = model.head_params * node.dtype_bytes

    def layers(extra: int) -> int:
        return max(0, min(model.num_layers, int((budget - extra) // per_layer)))

    mid = layers(0)
    if mid <= 0:
        return None
    return _Cand(
        node,
        mid,
        layers(embed),
        layers(head),
        layers(embed + head),
        layer_seconds(model, node),
        handoff_seconds(model, node),
        node.call_ms / 1e3,
    )


Chain = list[tuple[_Cand, int, int]]  # members in order, with their layers [start, end)


def _pick_ends(members: Sequence[_Cand]) -> tuple[int, int]:
    """Indices of the members that hold the embedding and the LM head: the pair that loses
    the fewest layers to them (a node with spare room, or one clipped at L, loses none).
    Among equals the slowest uploader goes last: the last member hands nothing on."""
    if len(members) == 1:
        return 0, 0
    loss_f = [c.mid - c.first for c in members]
    loss_l = [c.mid - c.last for c in members]
    by_f = sorted(range(len(members)), key=lambda i: (loss_f[i], members[i].send_s))[:2]
    by_l = sorted(range(len(members)), key=lambda i: (loss_l[i], -members[i].send_s))[:2]
    if by_f[0] != by_l[0]:
        return by_f[0], by_l[0]
    if loss_f[by_f[0]] + loss_l[by_l[1]] <= loss_f[by_f[1]] + loss_l[by_l[0]]:
        return by_f[0], by_l[1]
    return by_f[1], by_l[0]


def _end_pairs(members: Sequence[_Cand]) -> list[tuple[int, int]]:
    """Candidate (first, last) ends: the pair that loses the fewest layers, and the pair
    that puts the slowest uploader last when another member is last there. The last
    member hands nothing on, so on a chain with room to spare a slow uplink at the end
    saves every session its hand-off (at 7B a batch of 8 on DSL is 52 ms a token)."""
    if len(members) == 1:
        return [(0, 0)]
    f, last = _pick_ends(members)
    pairs = [(f, last)]
    slow = max(range(len(members)), key=lambda i: (members[i].send_s, members[i].node_id))
    if members[slow].send_s > members[last].send_s:
        first = min(
            (i for i in range(len(members)) if i != slow),
            key=lambda i: (members[i].mid - members[i].first, members[i].send_s, i),
        )
        pairs.append((first, slow))
    return pairs


def _ends(members: Sequence[_Cand], f: int, last: int) -> tuple[list[_Cand], list[int]]:
    """Members in chain order, `f` first and `last` last, with the layers each has room
    for."""
    if len(members) == 1:
        return list(members), [members[0].both]
    start, end = members[f].node.region, members[last].node.region
    # Each region's members together, from the first member's region to the last one's:
    # a chain that weaves between regions pays a backbone crossing at every change.
    middle = sorted(
        (c for i, c in enumerate(members) if i not in (f, last)),
        key=lambda c: (c.node.region != start, c.node.region == end, c.node.region),
    )
    return (
        [members[f], *middle, members[last]],
        [members[f].first, *(c.mid for c in middle), members[last].last],
    )


def _cover(model: ModelSpec, members: Sequence[_Cand]) -> int:
    """Layers the members hold together as one chain (0 if an end holds none)."""
    if len(members) == 1:
        return members[0].both
    f, last = _pick_ends(members)
    if members[f].first < 1 or members[last].last < 1:
        return 0
    total = sum(c.mid for c in members)
    return total - (members[f].mid - members[f].first) - (members[last].mid - members[last].last)


def _chain(model: ModelSpec, members: Sequence[_Cand]) -> Chain | None:
    """Give the members layers, fastest first, between the ends of `_end_pairs` that make
    the faster chain; None if they cannot cover [0, L).

    Middle members left without a layer are dropped from the chain.
    """
    pairs = _end_pairs(members)
    best = _layered(model, *_ends(members, *pairs[0]))
    for f, last in pairs[1:]:
        chain = _layered(model, *_ends(members, f, last))
        if chain is None:
            continue
        if best is None:
            best = chain
        elif len(chain) == len(best):
            best = min(best, chain, key=lambda c: _chain_seconds(model, c))
    return best


def _layered(model: ModelSpec, chain: list[_Cand], caps: list[int]) -> Chain | None:
    """Layers for a chain in order, fastest member first up to its room; None if they do
    not cover [0, L)."""
    n_layers = model.num_layers
    if sum(caps) < n_layers or caps[0] < 1 or caps[-1] < 1:
        return None
    sizes = [0] * len(chain)
    sizes[0] = 1
    sizes[-1] = 1
    left = n_layers - sum(sizes)
    for i in sorted(range(len(chain)), key=lambda i: (chain[i].seconds, chain[i].node_id)):
        take = min(caps[i] - sizes[i], left)
        sizes[i] += take
        left -= take
    if left > 0:
        return None
    out: Chain = []
    start = 0
    for cand, size in zip(chain, sizes, strict=True):
        if size:
            out.append((cand, start, start + size))
            start += size
    return out


def _bin_cover(model: ModelSpec, pool: list[_Cand]) -> tuple[list[Chain], list[_Cand]]:
    """As many pipelines as the pool covers: seed with the largest node, then complete it
    with the smallest node that does (least waste), else add the largest and go on."""
    n_layers = model.num_layers
    pool = sorted(pool, key=lambda c: (c.mid, c.both, -c.seconds, c.node_id))
    caps = [c.mid for c in pool]
    total = sum(caps)
    pipelines: list[Chain] = []
    while pool and total >= n_layers:
        members = [pool.pop()]
        caps.pop()
        total -= members[0].mid
        held = members[0].mid  # an upper bound on the chain's cover: skips most _cover calls
        while pool and (held < n_layers or _cover(model, members) < n_layers):
            deficit = n_layers - min(held, _cover(model, members) if held >= n_layers else held)
            i = bisect.bisect_left(caps, deficit)
            chosen = None
            for j in range(i, min(i + 4, len(pool))):
                if (
                    held + pool[j].mid >= n_layers
                    and _cover(model, [*members, pool[j]]) >= n_layers
                ):
                    chosen = j
                    break
            if chosen is None:
                chosen = len(pool) - 1
            members.append(pool.pop(chosen))
            caps.pop(chosen)
            total -= members[-1].mid
            held += members[-1].mid
        chain = _chain(model, members) if _cover(model, members) >= n_layers else None
        if chain is None:
            # Whatever is left cannot make another pipeline.
            pool.extend(members)
            break
        in_chain = {c.node_id for c, _, _ in chain}
        for c in members:
            if c.node_id not in in_chain:  # given no layer: back to the pool
                i = bisect.bisect_left(caps, c.mid)
                pool.insert(i, c)
                caps.insert(i, c.mid)
                total += c.mid
        pipelines.append(chain)
    return pipelines, pool


def _chain_seconds(model: ModelSpec, chain: Chain) -> float:
    """Estimated time per token through a chain."""
    compute = sum((b - a) * c.seconds + c.call_s for c, a, b in chain)
    return compute + network_seconds(model, [c.node for c, _, _ in chain])


def _chain_value(model: ModelSpec, chain: Chain, seconds: float | None = None) -> float:
    """The chain's term of the objective, from the candidates' cached layer times."""
    if seconds is None:
        seconds = _chain_seconds(model, chain)
    return pipeline_value(model, [(c.node, a, b) for c, a, b in chain], seconds)


def _own_seconds(c: _Cand) -> float:
    """What a member adds to its pipeline's time per token, for ranking nodes of a shape."""
    return c.mid * c.seconds + c.call_s + c.node.rtt_ms / 2000.0 + c.send_s


LARGE_SWARM_PIPELINES = 200


def _refine(model: ModelSpec, pipelines: list[Chain], rounds: int = 2) -> list[Chain]:
    """Local search on the objective: nodes of one shape (region and what fits) trade places
    across pipelines so that fast nodes end up together and slow ones together.

    Served tokens/s sums 1 / latency over pipelines, a convex function of the latencies: for
    the same nodes, spreading latencies apart (assortative grouping) serves more. Each
    shape's reassignment is kept only if the objective over the pipelines it touched rises.
    Sorting only: O(n log n) per round.
    """
    pipelines = list(pipelines)
    if len(pipelines) > LARGE_SWARM_PIPELINES:
        rounds = 1  # plan time: a second round gains little on thousands of nodes
    seconds = [_chain_seconds(model, chain) for chain in pipelines]
    values = [_chain_value(model, chain, t) for chain, t in zip(pipelines, seconds, strict=True)]
    # Positions refer to these member lists (chain order changes when a chain is rebuilt).
    members = [[c for c, _, _ in chain] for chain in pipelines]
    places: dict[tuple[str, int, int, int, int], list[tuple[int, int]]] = {}
    for p, group in enumerate(members):
        for i, c in enumerate(group):
            places.setdefault(c.shape, []).append((p, i))
    for _ in range(rounds):
        improved = False
        for spots in places.values():
            if len(spots) < 2:
                continue
            own = {(p, i): _own_seconds(members[p][i]) for p, i in spots}
            order = sorted(spots, key=own.__getitem__)
            nodes = [members[p][i] for p, i in order]
            rest = sorted(spots, key=lambda s: seconds[s[0]] - own[s])
            trial = {p: list(members[p]) for p, _ in spots}
            touched = set()
            for (p, i), node in zip(rest, nodes, strict=True):
                if trial[p][i] is not node:
                    trial[p][i] = node
                    touched.add(p)
            if not touched:
                continue
            rebuilt = {p: _chain(model, trial[p]) for p in touched}
            if any(chain is None or len(chain) != len(trial[p]) for p, chain in rebuilt.items()):
                continue
            new_seconds = {p: _chain_seconds(model, chain) for p, chain in rebuilt.items()}  # type: ignore[arg-type]
            new_values = {
                p: _chain_value(model, chain, new_seconds[p])  # type: ignore[arg-type]
                for p, chain in rebuilt.items()
            }
            if sum(new_values.values()) > sum(values[p] for p in touched) * (1 + 1e-9):
                for p, chain in rebuilt.items():
                    pipelines[p] = chain  # type: ignore[assignment]
                    members[p] = trial[p]
                    seconds[p] = new_seconds[p]
                    values[p] = new_values[p]
                improved = True
        if not improved:
            break
    return pipelines


SWAP_TRIES_PER_PIPELINE = 200
MAX_SWAP_TRIES = 3000  # bounds plan time on large swarms (about 0.1 s)


def _swap_search(
    model: ModelSpec, pipelines: list[Chain], spares: list[_Cand]
) -> tuple[list[Chain], list[_Cand]]:
    """Local search on the objective across shapes, by pairs drawn from a fixed
    pseudo-random sequence (plans stay reproducible):

    - two members of two pipelines (same region) trade places when both pipelines still
      cover [0, L) and the objective rises;
    - a spare (a node in no pipeline, same region) takes a member's place when the
      pipeline still covers [0, L) and its term rises: a faster or more reliable node that
      bin covering left over replaces a slower or flakier one, which becomes the spare.
    """
    count = len(pipelines)
    if count == 0:
        return pipelines, spares
    pipelines, spares = list(pipelines), list(spares)
    values = [_chain_value(model, chain) for chain in pipelines]
    state = 0x2545F491
    tries = min(SWAP_TRIES_PER_PIPELINE * count, MAX_SWAP_TRIES) if count > 1 else 0
    for _ in range(tries):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        p, q = (state >> 11) % count, (state >> 29) % count
        if p == q:
            continue
        i, j = (state >> 40) % len(pipelines[p]), (state >> 50) % len(pipelines[q])
        a, b = pipelines[p][i][0], pipelines[q][j][0]
        if a.node.region != b.node.region:
            continue  # other region: more cross-region hops
        # Same shape too: _refine's sort can leave symmetric mixes (fast+slow, fast+slow)
        # that only a pairwise swap separates.
        mp = [c for c, _, _ in pipelines[p]]
        mq = [c for c, _, _ in pipelines[q]]
        mp[i], mq[j] = b, a
        cp, cq = _chain(model, mp), _chain(model, mq)
        if cp is None or cq is None or len(cp) != len(mp) or len(cq) != len(mq):
            continue
        vp, vq = _chain_value(model, cp), _chain_value(model, cq)
        if vp + vq > (values[p] + values[q]) * (1 + 1e-9):
            pipelines[p], pipelines[q] = cp, cq
            values[p], values[q] = vp, vq
    if not spares:
        return pipelines, spares
    for _ in range(min(SWAP_TRIES_PER_PIPELINE * len(spares), MAX_SWAP_TRIES)):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        p, k = (state >> 11) % count, (state >> 29) % len(spares)
        i = (state >> 40) % len(pipelines[p])
        member, spare = pipelines[p][i][0], spares[k]
        if member.node.region != spare.node.region:
            continue
        trial = [c for c, _, _ in pipelines[p]]
        trial[i] = spare
        chain = _chain(model, trial)
        if chain is None or len(chain) != len(trial):
            continue
        value = _chain_value(model, chain)
        if value > values[p] * (1 + 1e-9):
            pipelines[p], values[p] = chain, value
            spares[k] = member
    return pipelines, spares


def _by_quality(model: ModelSpec, pool: list[_Cand]) -> tuple[list[Chain], list[_Cand]]:
    """Bin covering in order of quality: the nodes that cost a token the least per layer
    they hold (their compute, plus their hand-off spread over their layers) are covered
    into pipelines first, each pipeline from the best nodes left, so that fibre uplinks and
    fast cards serve together and slow ones together. Served tokens/s is convex in the
    pipelines' times: for the same nodes, latencies spread apart serve more."""
    order = sorted(pool, key=lambda c: (c.seconds + c.send_s / c.mid, c.node_id))
    pipelines: list[Chain] = []
    batch: list[_Cand] = []
    held, attempt = 0, model.num_layers
    for c in order:
        batch.append(c)
        held += c.mid
        if held >= attempt:
            made, batch = _bin_cover(model, batch)
            pipelines += made
            held = sum(x.mid for x in batch)
            # A batch that holds L layers but chains none (the embedding or the head does
            # not fit) waits for an eighth of a pipeline more: plan time stays linear.
            attempt = model.num_layers if made else held + model.num_layers // 8
    return pipelines, batch


def _plan_value(model: ModelSpec, pipelines: Sequence[Chain]) -> float:
    return sum(_chain_value(model, chain) for chain in pipelines)


def _form_pipelines(model: ModelSpec, cands: list[_Cand]) -> tuple[list[Chain], list[_Cand]]:
    """Pipelines inside each region first (no cross-region hops), then across regions.
    Each region keeps plain bin covering, which makes the most pipelines, unless covering
    by quality, which makes the fastest ones, is worth more to the objective (by more than
    rounding: equal plans must not flip with a factor common to all pipelines, such as
    equal availabilities)."""
    by_region: dict[str, list[_Cand]] = {}
    for c in cands:
        by_region.setdefault(c.node.region, []).append(c)
    pipelines: list[Chain] = []
    rest: list[_Cand] = []
    for region in sorted(by_region):
        made, left = _bin_cover(model, by_region[region])
        fast, slow = _by_quality(model, by_region[region])
        if _plan_value(model, fast) > _plan_value(model, made) * (1 + 1e-9):
            made, left = fast, slow
        pipelines += made
        rest += left
    if len(by_region) > 1:
        made, rest = _bin_cover(model, rest)
        pipelines += made
    pipelines, rest = _swap_search(model, _refine(model, pipelines), rest)
    return _within_bound(model, pipelines, rest)


def _within_bound(
    model: ModelSpec, pipelines: list[Chain], rest: list[_Cand]
) -> tuple[list[Chain], list[_Cand]]:
    """Dissolve the pipelines the local search could not bring under the latency and price
    bounds: their members become spares (replicas that routes may still mix in). When no
    pipeline meets the bounds one stays, so the model is served: of those formed, the one
    least over the price bound, the fastest of those."""
    bounded = model.max_token_latency_s > 0 or model.max_token_price > 0
    if not bounded or not pipelines:
        return pipelines, rest
    inside = [c for c in pipelines if _chain_value(model, c) > 0]
    if not inside:
        inside = [min(pipelines, key=lambda c: _fallback_key(model, c))]
    kept = {id(c) for c in inside}
    rest = rest + [m for c in pipelines if id(c) not in kept for m, _, _ in c]
    return inside, rest


def _fallback_key(model: ModelSpec, chain: Chain) -> tuple[float, float]:
    """How far a chain is over the price bound (0 within it, or with none), then its time."""
    price = token_price((c.node, a, b) for c, a, b in chain)
    over = max(0.0, price - model.max_token_price) if model.max_token_price > 0 else 0.0
    return over, _chain_seconds(model, chain)


def _place_chain(
    model: ModelSpec,
    model_plan: ModelPlan,
    chain: Chain,
    used: dict[str, int],
) -> None:
    for cand, a, b in chain:
        model_plan.holders[cand.node_id] = Shard(model.name, a, b)
        used[cand.node_id] += shard_bytes(model, cand.node, a, b)
    model_plan.pipelines.append(tuple(c.node_id for c, _, _ in chain))


def _fill_floor(
    model: ModelSpec,
    model_plan: ModelPlan,
    spares: list[_Cand],
    used: dict[str, int],
    replicas: int,
) -> None:
    """Spare nodes replicate the least-covered layers until every layer has `replicas`
    holders; the others stay idle, ready to repair a pipeline or to start a new one."""
    if not model_plan.holders:
        return
    n_layers = model.num_layers
    counts = model_plan.layer_coverage()
    for cand in sorted(spares, key=lambda c: (-c.mid, c.node_id)):
        if min(counts) >= replicas and not SPARES_REPLICATE:
            return
        prefix = [0]
        for n in counts:
            prefix.append(prefix[-1] + n)
        best: tuple[float, int, int, int] | None = None
        for start in range(n_layers):
            size = min(cand.first if start == 0 else cand.mid, n_layers - start)
            if start + size == n_layers:
                size = min(size, cand.both if start == 0 else cand.last)
            if size <= 0:
                continue
            mean = (prefix[start + size] - prefix[start]) / size
            key = (mean, -size, start, start + size)
            if best is None or key < best:
                best = key
        if best is None:
            continue
        a, b = best[2], best[3]
        model_plan.holders[cand.node_id] = Shard(model.name, a, b)
        used[cand.node_id] += shard_bytes(model, cand.node, a, b)
        for layer in range(a, b):
            counts[layer] += 1


def _fresh_pipelines(
    model: ModelSpec, nodes: list[NodeSpec], used: dict[str, int], replicas: int
) -> ModelPlan:
    model_plan = ModelPlan(model.name, [0, model.num_layers])
    cands = [c for n in nodes if (c := _candidate(model, n, used[n.node_id])) is not None]
    pipelines, rest = _form_pipelines(model, cands)
    for chain in pipelines:
        _place_chain(model, model_plan, chain, used)
    _fill_floor(model, model_plan, rest, used, replicas)
    return model_plan


def _plan_pipelines(
    model: ModelSpec,
    nodes: list[NodeSpec],
    by_id: Mapping[str, NodeSpec],
    used: dict[str, int],
    old: ModelPlan | None,
    replicas: int,
    hysteresis: float,
) -> ModelPlan:
    if old is None:
        return _fresh_pipelines(model, nodes, used, replicas)
    before = dict(used)
    candidates = replan_candidates(model, nodes, old, replicas, used)
    choice = choose_replan(model, old, candidates, by_id, hysteresis)
    used.clear()
    used.update(before)
    for node_id, shard in candidates[choice].holders.items():
        used[node_id] += shard_bytes(model, by_id[node_id], shard.start, shard.end)
    return candidates[choice]


def replan_candidates(
    model: ModelSpec,
    nodes: Sequence[NodeSpec],
    old: ModelPlan,
    replicas: int,
    used: Mapping[str, int] | None = None,
) -> dict[str, ModelPlan]:
    """The plans a re-plan chooses from (`choose_replan`), cheapest to move first:

    - kept: no surviving shard moves; broken pipelines repaired by idle nodes; idle nodes
      form new pipelines; the rest replicate.
    - repaired: as kept, but replicas outside pipelines are idle too (they repair broken
      pipelines and form new ones), and survivors of pipelines that cannot be repaired
      rejoin the pool: whole pipelines never move.
    - fresh: everything planned from scratch.
    """
    node_list = sorted(nodes, key=lambda n: (-n.speed, -n.usable_bytes, n.node_id))
    by_id = {n.node_id: n for n in node_list}
    base = dict(used) if used is not None else {n.node_id: 0 for n in node_list}
    kept = _kept_pipelines(model, node_list, by_id, dict(base), old, replicas)
    fresh = _fresh_pipelines(model, node_list, dict(base), replicas)
    repaired = _kept_pipelines(model, node_list, by_id, dict(base), old, replicas, release=True)
    return {"kept": kept, "repaired": repaired, "fresh": fresh}


def choose_replan(
    model: ModelSpec,
    old: ModelPlan,
    candidates: Mapping[str, ModelPlan],
    nodes: Mapping[str, NodeSpec],
    hysteresis: float,
) -> str:
    """Keep the plan unless another one is worth its moves (`worth_moving`); a kept plan
    that cannot serve the model gives way to the candidate that can, moving least."""
    kept = candidates["kept"]
    base = estimated_tokens_per_s(model, kept, nodes)
    complete = [name for name in ("repaired", "fresh") if not candidates[name].missing_layers()]
    if kept.missing_layers() and complete:
        return min(complete, key=lambda n: move_seconds(model, old, candidates[n], nodes))
    # A ladder, cheapest move first: each step must be worth its own moves over the plan
    # it would replace (a fresh plan must beat the repaired one, not only the kept one).
    best, best_value = "kept", base
    for name in ("repaired", "fresh"):
        plan_ = candidates[name]
        if plan_.missing_layers() and not kept.missing_layers():
            continue
        gain = estimated_tokens_per_s(model, plan_, nodes)
        move = move_seconds(model, old, plan_, nodes)
        if worth_moving(best_value, gain, move, hysteresis):
            best, best_value = name, gain
    return best


def worth_moving(kept: float, new: float, move_s: float, hysteresis: float) -> bool:
    """Switch to a plan serving `new` tokens/s (estimated) from one serving `kept` when the
    move, `move_s` seconds of downloads during which the old shards keep serving (load
    before drop), gains more than `hysteresis` x kept over the payback horizon:

        (new - kept) x (PAYBACK_S - move_s) > hysteresis x kept x PAYBACK_S

    With instant moves this is new > kept x (1 + hysteresis); a move as long as the
    horizon is never worth it."""
    if math.isinf(hysteresis) or move_s >= PAYBACK_S:
        return False
    return (new - kept) * (PAYBACK_S - move_s) > hysteresis * kept * PAYBACK_S


def fetch_bytes(model: ModelSpec, node: NodeSpec, old: Shard | None, new: Shard) -> int:
    """Weights `node` must download to serve `new`: layers (and the embedding or LM head)
    that neither its current shard nor a cached one holds."""
    have = [s for s in (old, *node.cached) if s is not None and s.model == new.model]
    missing = sum(
        1 for layer in range(new.start, new.end) if not any(s.start <= layer < s.end for s in have)
    )
    total = missing * model.params_per_layer
    if new.start == 0 and not any(s.start == 0 for s in have):
        total += model.embed_params
    if new.end == model.num_layers and not any(s.end == model.num_layers for s in have):
        total += model.head_params
    return total * node.dtype_bytes


def move_seconds(
    model: ModelSpec, old: ModelPlan, new: ModelPlan, nodes: Mapping[str, NodeSpec]
) -> float:
    """How long the move from `old` to `new` downloads: nodes fetch in parallel, so the
    slowest node's bytes / its download rate."""
    slowest = 0.0
    for node_id, shard in new.holders.items():
        node = nodes.get(node_id)
        if node is None:
            continue
        fetched = fetch_bytes(model, node, old.holders.get(node_id), shard)
        if fetched:
            rate = (node.download_mbps or DEFAULT_DOWNLOAD_MBPS) * 1e6 / 8
            slowest = max(slowest, fetched / rate)
    return slowest


def _kept_pipelines(
    model: ModelSpec,
    nodes: list[NodeSpec],
    by_id: Mapping[str, NodeSpec],
    used: dict[str, int],
    old: ModelPlan,
    replicas: int,
    *,
    release: bool = False,
) -> ModelPlan:
    """The previous plan minus vanished nodes; broken pipelines repaired with idle nodes;
    idle nodes forming new pipelines. No surviving shard moves.

    `release`: replicas outside pipelines, and survivors of pipelines that cannot be
    repaired, are idle too (their shards may move); pipelines that are whole stay put."""
    n_layers = model.num_layers
    kept = ModelPlan(model.name, [0, n_layers])
    if old.boundaries[-1] != n_layers:
        old = ModelPlan(model.name, [0, n_layers])
    in_pipeline = {nid for pipe in old.pipelines for nid in pipe}
    for node_id, shard in old.holders.items():
        node = by_id.get(node_id)
        if release and node_id not in in_pipeline:
            continue
        if node and fits(model, node, shard.start, shard.end, used[node_id]):
            kept.holders[node_id] = shard
            used[node_id] += shard_bytes(model, node, shard.start, shard.end)
    idle = [
        c
        for n in nodes
        if n.node_id not in kept.holders
        and (c := _candidate(model, n, used[n.node_id])) is not None
    ]
    for pipe in old.pipelines:
        survivors = [nid for nid in pipe if nid in kept.holders]
        if len(survivors) == len(pipe):
            kept.pipelines.append(pipe)
            continue
        if not survivors:
            continue
        repaired = _repair(model, kept, survivors, idle, by_id, used)
        if repaired is None and not release:
            # Replicas outside pipelines are fail-over alternates: when no idle node
            # can fill the hole, one of them moves into it (only it fetches weights).
            spares = _spare_candidates(model, kept, in_pipeline, by_id, used)
            repaired = _repair(model, kept, survivors, spares, by_id, used)
        if repaired is not None:
            kept.pipelines.append(repaired)
        elif release:
            for nid in survivors:
                shard = kept.holders.pop(nid)
                used[nid] -= shard_bytes(model, by_id[nid], shard.start, shard.end)
                if (c := _candidate(model, by_id[nid], used[nid])) is not None:
                    idle.append(c)
    pipelines, rest = _form_pipelines(model, idle)
    for chain in pipelines:
        _place_chain(model, kept, chain, used)
    _fill_floor(model, kept, rest, used, replicas)
    return kept


def _spare_candidates(
    model: ModelSpec,
    kept: ModelPlan,
    old_members: set[str],
    by_id: Mapping[str, NodeSpec],
    used: Mapping[str, int],
) -> list[_Cand]:
    """Holders that were in no pipeline and are in none now (replicas), sized as if their
    replica shard were dropped."""
    members = old_members | {nid for pipe in kept.pipelines for nid in pipe}
    spares = []
    for nid, shard in kept.holders.items():
        if nid in members:
            continue
        node = by_id[nid]
        free = used[nid] - shard_bytes(model, node, shard.start, shard.end)
        if (c := _candidate(model, node, free)) is not None:
            spares.append(c)
    return spares


def _repair(
    model: ModelSpec,
    kept: ModelPlan,
    survivors: list[str],
    idle: list[_Cand],
    by_id: Mapping[str, NodeSpec],
    used: dict[str, int],
) -> tuple[str, ...] | None:
    """Fill the holes a departed member left with the smallest idle node that holds each
    (same region first). None when a hole cannot be filled; survivors then stay replicas."""
    n_layers = model.num_layers
    spans = sorted((kept.holders[nid].start, kept.holders[nid].end) for nid in survivors)
    holes: list[tuple[int, int]] = []
    reached = 0
    for a, b in spans:
        if a > reached:
            holes.append((reached, a))
        reached = max(reached, b)
    if reached < n_layers:
        holes.append((reached, n_layers))
    region = by_id[survivors[0]].region
    picks: Chain = []
    taken: set[str] = set()
    for a, b in holes:
        best = _hole_filler(model, idle, taken, region, a, b)
        if best is not None:
            picks.append((best, a, b))
            taken.add(best.node_id)
            continue
        # No idle node holds the whole hole: cover it with several, largest first.
        p = a
        while p < b:
            part = _largest_filler(model, idle, taken, region, p, b)
            if part is None:
                return None
            picks.append(part)
            taken.add(part[0].node_id)
            p = part[2]
    for cand, a, b in picks:
        replaced = kept.holders.pop(cand.node_id, None)  # a spare replica moving in
        if replaced is not None:
            used[cand.node_id] -= shard_bytes(model, cand.node, replaced.start, replaced.end)
        kept.holders[cand.node_id] = Shard(model.name, a, b)
        used[cand.node_id] += shard_bytes(model, cand.node, a, b)
    idle[:] = [c for c in idle if c.node_id not in taken]
    members = survivors + [c.node_id for c, _, _ in picks]
    return tuple(sorted(members, key=lambda nid: kept.holders[nid].start))


def _room(model: ModelSpec, c: _Cand, a: int, b: int) -> int:
    """Layers c holds in a range [a, b) (the embedding with layer 0, the head with L)."""
    n_layers = model.num_layers
    if a == 0:
        return c.both if b == n_layers else c.first
    return c.last if b == n_layers else c.mid


def _hole_filler(
    model: ModelSpec, idle: Sequence[_Cand], taken: set[str], region: str, a: int, b: int
) -> _Cand | None:
    """The idle node that fills [a, b) alone: same region, cached, smallest, fastest first."""
    best: _Cand | None = None
    best_key: tuple[bool, bool, int, float, str] | None = None
    for c in idle:
        if c.node_id in taken:
            continue
        room = _room(model, c, a, b)
        if room < b - a:
            continue
        cached = any(x.model == model.name and x.covers(a, b) for x in c.node.cached)
        key = (c.node.region != region, not cached, room, c.seconds, c.node_id)
        if best_key is None or key < best_key:
            best, best_key = c, key
    return best


def _largest_filler(
    model: ModelSpec, idle: Sequence[_Cand], taken: set[str], region: str, p: int, b: int
) -> tuple[_Cand, int, int] | None:
    """The idle node (same region first) that covers the most of [p, b) from p."""
    best: tuple[_Cand, int, int] | None = None
    best_key: tuple[bool, int, float, str] | None = None
    for c in idle:
        if c.node_id in taken:
            continue
        q = min(b, p + _room(model, c, p, p + 1))
        if _room(model, c, p, q) < q - p:  # the head makes it lose layers at the end
            q = p + _room(model, c, p, q)
        if q <= p:
            continue
        key = (c.node.region != region, -(q - p), c.seconds, c.node_id)
        if best_key is None or key < best_key:
            best, best_key = (c, p, q), key
    return best


# ---- one stage layout (min_stages > 1) ------------------------------------------------------


def _plan_layout(
    model: ModelSpec,
    node_list: list[NodeSpec],
    by_id: Mapping[str, NodeSpec],
    used: dict[str, int],
    old: ModelPlan | None,
    replicas: int,
    min_stages: int,
) -> ModelPlan:
    if old is not None and old.pipelines:
        old = None  # a pipeline plan has no layout to keep
    if old is not None and _deepens(old, model, node_list, used, min_stages):
        old = None
    before = dict(used)
    model_plan = _surviving(old, model, by_id, used) if old else None
    if model_plan is not None:
        _fill_replicas(model_plan, model, node_list, used, replicas)
        if model_plan.missing_layers():
            # The survivors cannot fill the hole in the old layout: cut a new one
            # rather than keep a model unservable while nodes sit idle.
            used.clear()
            used.update(before)
            model_plan = None
    if model_plan is None:
        model_plan = _fresh_layout(model, node_list, used, min_stages)
        if model_plan is None:
            return ModelPlan(model.name, [0, model.num_layers])
        _fill_replicas(model_plan, model, node_list, used, replicas)
    return model_plan


def _deepens(
    old: ModelPlan, model: ModelSpec, nodes: list[NodeSpec], used: dict[str, int], min_stages: int
) -> bool:
    """Whether a fresh layout would have more stages than `old` while `old` has fewer than
    the operator asked for. A layout is kept across re-plans so shards stay put, but one cut
    while few nodes were online (the first node to join alone cuts a single stage) would
    otherwise stay that shallow however many nodes join after it."""
    if len(old.boundaries) - 1 >= min(min_stages, model.num_layers):
        return False
    deeper = _fresh_layout(model, nodes, dict(used), min_stages)
    return deeper is not None and len(deeper.boundaries) > len(old.boundaries)


def _surviving(
    old: ModelPlan, model: ModelSpec, by_id: Mapping[str, NodeSpec], used: dict[str, int]
) -> ModelPlan | None:
    """The previous plan minus vanished nodes, if its layout still has a full pipeline."""
    if old.boundaries[-1] != model.num_layers:
        return None
    kept = ModelPlan(model.name, list(old.boundaries))
    for node_id, shard in old.holders.items():
        node = by_id.get(node_id)
        if node and fits(model, node, shard.start, shard.end, used[node_id]):
            kept.holders[node_id] = shard
            used[node_id] += shard_bytes(model, node, shard.start, shard.end)
    return kept


def _fresh_layout(
    model: ModelSpec, nodes: list[NodeSpec], used: dict[str, int], min_stages: int
) -> ModelPlan | None:
    """Pick the first pipeline and cut the layers in proportion to its nodes' speed."""
    free = [n for n in nodes if max_layers(model, n, used[n.node_id]) > 0]
    if not free:
        return None
    # Fewest stages first (fewest network hops), strongest nodes first.
    by_capacity = sorted(free, key=lambda n: -max_layers(model, n, used[n.node_id]))
    covered, count = 0, 0
    for node in by_capacity:
        covered += max_layers(model, node, used[node.node_id])
        count += 1
        if covered >= model.num_layers:
            break
    if covered < model.num_layers:
        return None
    # More stages than memory needs only when the operator asks for deeper pipelines.
    stages = min(max(count, min_stages), model.num_layers, len(free))
    pipeline = by_capacity[:stages]
    sizes = _water_fill(
        model.num_layers,
        [n.speed for n in pipeline],
        [max_layers(model, n, used[n.node_id]) for n in pipeline],
    )
    if sizes is None:
        return None
    boundaries = [0]
    for size in sizes:
        boundaries.append(boundaries[-1] + size)
    model_plan = ModelPlan(model.name, boundaries)
    for node, (a, b) in zip(pipeline, model_plan.stages(), strict=True):
        model_plan.holders[node.node_id] = Shard(model.name, a, b)
        used[node.node_id] += shard_bytes(model, node, a, b)
    return model_plan


def _water_fill(total: int, weights: list[float], caps: list[int]) -> list[int] | None:
    """Split `total` layers in proportion to weights, each in [1, cap]; None if impossible."""
    n = len(weights)
    if n == 0 or sum(caps) < total or total < n:
        return None
    sizes = [0] * n
    open_idx = list(range(n))
    remaining = total
    while open_idx:
        weight_sum = sum(max(weights[i], 1e-9) for i in open_idx)
        shares = {i: remaining * max(weights[i], 1e-9) / weight_sum for i in open_idx}
        capped = [i for i in open_idx if shares[i] >= caps[i]]
        if not capped:
            floors = {i: max(1, math.floor(shares[i])) for i in open_idx}
            left = remaining - sum(floors.values())
            by_fraction = sorted(
                open_idx, key=lambda i: shares[i] - math.floor(shares[i]), reverse=True
            )
            for i in by_fraction:
                if left <= 0:
                    break
                if floors[i] < caps[i]:
                    floors[i] += 1
                    left -= 1
            for i in sorted(open_idx, key=lambda i: floors[i], reverse=True):
                while left < 0 and floors[i] > 1:
                    floors[i] -= 1
                    left += 1
            if left != 0:
                return None
            for i in open_idx:
                sizes[i] = floors[i]
            return sizes
        for i in capped:
            sizes[i] = caps[i]
            remaining -= caps[i]
            open_idx.remove(i)
    return sizes if remaining == 0 else None


def _fill_replicas(
    model_plan: ModelPlan,
    model: ModelSpec,
    nodes: list[NodeSpec],
    used: dict[str, int],
    replicas: int,
) -> None:
    stages = model_plan.stages()
    counts = model_plan.replicas_per_stage()
    # 1. Idle nodes join the stage with the fewest holders that fits them. `replicas` is
    # a floor, not a cap: every extra holder is extra served throughput.
    for node in nodes:
        if node.node_id in model_plan.holders:
            continue
        order = sorted(
            range(len(stages)), key=lambda i: (counts[i], -(stages[i][1] - stages[i][0]))
        )
        for i in order:
            a, b = stages[i]
            if fits(model, node, a, b, used[node.node_id]):
                model_plan.holders[node.node_id] = Shard(model.name, a, b)
                used[node.node_id] += shard_bytes(model, node, a, b)
                counts[i] += 1
                break
    # 2. Holders with spare memory grow into a neighbouring stage that lacks replicas.
    by_id = {n.node_id: n for n in nodes}
    grew = True
    while grew:
        grew = False
        counts = model_plan.replicas_per_stage()
        for i in sorted(range(len(stages)), key=lambda i: counts[i]):
            if counts[i] >= replicas:
                break
            a, b = stages[i]
            candidates = [
                (nid, s)
                for nid, s in model_plan.holders.items()
                if (s.end == a or s.start == b) and nid in by_id
            ]
            candidates.sort(key=lambda c: (-by_id[c[0]].speed, c[0]))
            for nid, shard in candidates:
                node = by_id[nid]
                start, end = min(shard.start, a), max(shard.end, b)
                before = shard_bytes(model, node, shard.start, shard.end)
                if fits(model, node, start, end, used[nid] - before):
                    model_plan.holders[nid] = Shard(model.name, start, end)
                    used[nid] += shard_bytes(model, node, start, end) - before
                    grew = True
                    break
            if grew:
                break
