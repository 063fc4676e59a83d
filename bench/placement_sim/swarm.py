"""Simulated nodes, the swarm they form, and the performance model every system is judged by.

Performance model (the same for every system; all of it is in this file):

  * Memory. A node's usable memory mirrors the node agent's probe for CUDA cards (total
    minus max(10 %, 0.5 GiB)); every system then keeps the planner's HEADROOM free and
    reserves a KV cache of `kv_tokens` tokens for each layer it holds. The embedding and
    the LM head cost memory only where a system puts them.
  * Time of one decode step for `b` sessions over one layer on a node (roofline):
        max(b * flops_per_token / (fp16_tflops * compute_eff),
            (layer_bytes + b * mean_context * kv_bytes_per_token) / (bandwidth * memory_eff))
    Decode with a few sessions is bound by memory bandwidth, as on real cards.
  * Hand-off: a node sends the batch's hidden states to the next hop over its upload link
    (b * hidden * 2 bytes), and the bytes then travel one way: RTT / 2.
  * Each node keeps KV cache for `slots = kv_tokens // context_tokens` sessions; a session
    needs a slot on every node it passes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from coordinator.planner import HEADROOM

from .gpus import GIB, GpuSpec
from .models import ModelShape
from .regions import Site, rtt_matrix_ms, rtt_ms

# node_agent/hardware_probe.py keeps max(10 %, 0.5 GiB) of a CUDA card for the driver,
# the CUDA context and the owner's desktop.
CUDA_HEADROOM_FRACTION = 0.10
CUDA_HEADROOM_MIN = GIB // 2


@dataclass(frozen=True)
class ServingParams:
    # KV budget per shard, as a coordinator started with `serve` gives every shard
    # (coordinator.settings.Settings.kv_tokens_per_shard; bench/placement.py --kv-tokens).
    kv_tokens: int = 4096
    context_tokens: int = 512  # context a session keeps in cache
    compute_efficiency: float = 0.5  # achieved share of peak tensor TFLOPS
    memory_efficiency: float = 0.75  # achieved share of peak memory bandwidth
    # A client that runs the LM head itself (Petals) does so on its CPU: fp16 weights
    # read once per token at this rate (dual-channel DDR4-3200 peaks at 51.2 GB/s).
    client_memory_gbps: float = 25.0

    @property
    def slots(self) -> int:
        return max(1, self.kv_tokens // self.context_tokens)

    @property
    def mean_context(self) -> int:
        return self.context_tokens // 2  # a live session is half-way through on average


@dataclass(frozen=True)
class SimNode:
    node_id: str
    gpu: GpuSpec
    site: Site
    joined_s: float = 0.0  # when its session began, on the churn trace's clock

    @property
    def usable_bytes(self) -> int:
        total = self.gpu.memory_bytes
        return max(0, total - max(int(total * CUDA_HEADROOM_FRACTION), CUDA_HEADROOM_MIN))

    @property
    def budget_bytes(self) -> float:
        return self.usable_bytes * (1 - HEADROOM)

    @property
    def up_bps(self) -> float:
        return self.site.access.up_mbps * 1e6

    @property
    def down_bps(self) -> float:
        return self.site.access.down_mbps * 1e6


def per_layer_bytes(model: ModelShape, params: ServingParams) -> int:
    return model.layer_bytes + params.kv_tokens * model.kv_bytes_per_token_per_layer


def layer_capacity(
    node: SimNode,
    model: ModelShape,
    params: ServingParams,
    extra_bytes: int = 0,
    clip: bool = True,
) -> int:
    """Layers the node can hold next to `extra_bytes` (embedding or head); at most L when
    `clip`, else what the memory would take."""
    free = node.budget_bytes - extra_bytes
    if free <= 0:
        return 0
    layers = int(free // per_layer_bytes(model, params))
    return min(model.num_layers, layers) if clip else layers


def roofline_s(node: SimNode, params: ServingParams, flops: float, moved_bytes: float) -> float:
    """Time of work that does `flops` and reads `moved_bytes`: whichever bound is slower."""
    compute = flops / (node.gpu.fp16_tflops * 1e12 * params.compute_efficiency)
    memory = moved_bytes / (node.gpu.memory_gbps * 1e9 * params.memory_efficiency)
    return max(compute, memory)


def layer_time_s(node: SimNode, model: ModelShape, params: ServingParams, batch: int) -> float:
    """One decode step of `batch` sessions through one layer (roofline)."""
    batch = max(1, batch)
    flops = batch * model.flops_per_token_per_layer(params.mean_context)
    moved = model.layer_bytes + batch * params.mean_context * model.kv_bytes_per_token_per_layer
    return roofline_s(node, params, flops, moved)


def handoff_s(node: SimNode, model: ModelShape, batch: int) -> float:
    """Time to push a batch's hidden states out of the node's upload link."""
    return max(1, batch) * model.activation_bytes * 8 / node.up_bps


def head_time_s(node: SimNode, model: ModelShape, params: ServingParams, batch: int) -> float:
    """The LM head for `batch` sessions on the node's GPU (roofline, fp16 weights)."""
    flops = 2.0 * max(1, batch) * model.head_params
    return roofline_s(node, params, flops, model.head_params * 2)


def client_head_time_s(model: ModelShape, params: ServingParams) -> float:
    """The LM head on the client's CPU: its fp16 weights read once per token."""
    return model.head_params * 2 / (params.client_memory_gbps * 1e9)


@dataclass(frozen=True)
class Hop:
    node_id: str
    start: int
    end: int

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass
class Swarm:
    """The nodes present now, for one model, with cached per-node arrays."""

    model: ModelShape
    params: ServingParams
    nodes: dict[str, SimNode] = field(default_factory=dict)

    @classmethod
    def of(cls, model: ModelShape, params: ServingParams, nodes: Iterable[SimNode]) -> Swarm:
        return cls(model, params, {n.node_id: n for n in nodes})

    def add(self, node: SimNode) -> None:
        self.nodes[node.node_id] = node
        self._invalidate()

    def remove(self, node_id: str) -> None:
        del self.nodes[node_id]
        self._invalidate()

    def _invalidate(self) -> None:
        for name in ("ids", "index", "rtt_ms"):
            self.__dict__.pop(name, None)

    @cached_property
    def ids(self) -> list[str]:
        return list(self.nodes)

    @cached_property
    def index(self) -> dict[str, int]:
        return {nid: i for i, nid in enumerate(self.ids)}

    @cached_property
    def rtt_ms(self) -> np.ndarray:
        return rtt_matrix_ms([self.nodes[nid].site for nid in self.ids])

    def rtt_s(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        return float(self.rtt_ms[self.index[a], self.index[b]]) / 1000.0

    def client_rtt_s(self, client: Site, node_id: str) -> float:
        return rtt_ms(client, self.nodes[node_id].site) / 1000.0

    def capacity(self, node_id: str, extra_bytes: int = 0, clip: bool = True) -> int:
        return layer_capacity(self.nodes[node_id], self.model, self.params, extra_bytes, clip)

    def layer_time_s(self, node_id: str, batch: int) -> float:
        return layer_time_s(self.nodes[node_id], self.model, self.params, batch)


def session_latency_s(
    swarm: Swarm,
    client: Site,
    hops: list[Hop],
    load: dict[str, int],
    client_runs_head: bool = False,
) -> float:
    """Time between two tokens of one session: the whole round through the pipeline, and
    the LM head where the system runs it: on the last node's GPU, batched like its layers,
    or on the client's CPU (Petals, whose client holds the embedding and the head)."""
    model, params = swarm.model, swarm.params
    total = swarm.client_rtt_s(client, hops[0].node_id) / 2
    for i, hop in enumerate(hops):
        node = swarm.nodes[hop.node_id]
        batch = load.get(hop.node_id, 1)
        total += hop.layers * layer_time_s(node, model, params, batch)
        if i + 1 < len(hops) and hops[i + 1].node_id != hop.node_id:
            total += handoff_s(node, model, batch)
            total += swarm.rtt_s(hop.node_id, hops[i + 1].node_id) / 2
    if client_runs_head:
        total += client_head_time_s(model, params)
    else:
        last = hops[-1].node_id
        total += head_time_s(swarm.nodes[last], model, params, load.get(last, 1))
    total += swarm.client_rtt_s(client, hops[-1].node_id) / 2
    return total


def nearest_peer_s(rtt: np.ndarray) -> np.ndarray:
    """Each node's round trip to its nearest other node, from a matrix of round trips (0
    for a node alone: a session on it never hops)."""
    if len(rtt) < 2:
        return np.zeros(len(rtt))
    return np.where(np.eye(len(rtt), dtype=bool), np.inf, rtt).min(axis=1)


def fetched_bytes(
    model: ModelShape,
    old: tuple[int, int] | None,
    new: tuple[int, int] | None,
    holds_ends: bool = True,
) -> int:
    """Weights a node must download to go from range `old` to range `new` (layer by layer).

    `holds_ends`: the node also holds the embedding when its range starts at 0 and the LM
    head when it ends at L (False for Petals, whose client runs them).
    """
    if new is None:
        return 0
    have = set(range(*old)) if old else set()
    gained = len(set(range(*new)) - have)
    total = gained * model.layer_bytes
    if holds_ends:
        if new[0] == 0 and not (old and old[0] == 0):
            total += model.embed_params * 2
        if new[1] == model.num_layers and not (old and old[1] == model.num_layers):
            total += model.head_params * 2
    return total


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b))
