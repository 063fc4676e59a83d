"""Planner v1: which node holds which contiguous layer range of which model.

A pure function over data (no I/O), so it can be property-tested and benchmarked.

The plan for a model has two levels:
  * a *stage layout*: [0, L) cut into S contiguous stages. S is the fewest stages the
    nodes' memory allows, raised to `min_stages` when the operator wants deeper pipelines.
    Stage sizes follow the measured speed of the nodes that form the first pipeline, so a
    fast node gets more layers, within its memory.
  * an *assignment*: each node holds one contiguous run of stages. The first full pipeline
    comes first; spare nodes then join the stages with the fewest replicas; nodes with
    spare memory finally grow their range into a neighbouring stage until every stage has
    `replicas` holders or nothing fits.

Re-planning keeps the layout and every surviving assignment, and only fills the gaps, so a
node leaving moves no weights except the ones that must move to restore coverage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Fraction of a node's usable memory kept free for activations, allocator slack and
# the owner's other programs. Petals' OOM reports (#308, #413) came from packing to 100%.
HEADROOM = 0.10


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    params_per_layer: int
    embed_params: int  # held by the first stage
    head_params: int  # final norm + LM head, held by the last stage
    kv_values_per_token_per_layer: int  # 2 * kv_heads * head_dim


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    usable_bytes: int
    speed: float  # relative compute speed (measured TFLOPS or better)
    dtype_bytes: int = 4  # 4 for fp32 on CPU, 2 for fp16/bf16 on GPU
    kv_tokens: int = 4096  # KV cache budget per shard, in tokens


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


@dataclass
class ModelPlan:
    model: str
    boundaries: list[int]  # stage cuts: [0, b1, ..., L]
    holders: dict[str, Shard] = field(default_factory=dict)  # node_id -> shard

    def stages(self) -> list[tuple[int, int]]:
        return list(zip(self.boundaries, self.boundaries[1:], strict=False))

    def replicas_per_stage(self) -> list[int]:
        return [sum(1 for s in self.holders.values() if s.covers(a, b)) for a, b in self.stages()]

    def missing_layers(self) -> list[tuple[int, int]]:
        return [
            stage
            for stage, n in zip(self.stages(), self.replicas_per_stage(), strict=True)
            if n == 0
        ]


def shard_bytes(model: ModelSpec, node: NodeSpec, start: int, end: int) -> int:
    """Weights plus the KV cache budget of a shard, in the node's compute dtype."""
    params = (end - start) * model.params_per_layer
    if start == 0:
        params += model.embed_params
    if end == model.num_layers:
        params += model.head_params
    kv = node.kv_tokens * (end - start) * model.kv_values_per_token_per_layer
    return (params + kv) * node.dtype_bytes


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


def plan(
    models: Iterable[ModelSpec],
    nodes: Iterable[NodeSpec],
    previous: Mapping[str, ModelPlan] | None = None,
    *,
    replicas: int = 2,
    min_stages: int = 1,
) -> dict[str, ModelPlan]:
    """Place every model on the nodes. Models are placed in the order given (priority)."""
    previous = previous or {}
    node_list = sorted(nodes, key=lambda n: (-n.speed, -n.usable_bytes, n.node_id))
    by_id = {n.node_id: n for n in node_list}
    used: dict[str, int] = {n.node_id: 0 for n in node_list}
    plans: dict[str, ModelPlan] = {}
    for model in models:
        old = previous.get(model.name)
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
                plans[model.name] = ModelPlan(model.name, [0, model.num_layers])
                continue
            _fill_replicas(model_plan, model, node_list, used, replicas)
        plans[model.name] = model_plan
    return plans


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
