"""Tiny hand-checkable swarms for the placement simulator tests."""

from __future__ import annotations

from placement_sim.gpus import GpuSpec
from placement_sim.models import ModelShape
from placement_sim.regions import AccessLine, Site
from placement_sim.swarm import ServingParams, SimNode, Swarm

# 4 layers; params per layer = 2*1024^2 (q, o) + 2*1024*1024 (k, v) + 3*1024*2048 (mlp)
# + 2*1024 (norms) = 10,487,808 -> 20,975,616 bytes in fp16.
TOY = ModelShape(
    "toy", num_layers=4, hidden=1024, intermediate=2048, heads=8, kv_heads=8, vocab=1000
)
# Efficiency 1.0 so hand arithmetic uses the spec sheet numbers as they are.
EXACT = ServingParams(
    kv_tokens=2048, context_tokens=512, compute_efficiency=1.0, memory_efficiency=1.0
)
# 1 TFLOPS, 100 GB/s: a toy layer is memory bound at small batches.
TOY_GPU = GpuSpec("toy-gpu", memory_gib=4, fp16_tflops=1.0, memory_gbps=100.0)
# RTT between two such sites in one region: 10 (backbone) + 5 + 5 = 20 ms; upload 8 Mb/s.
LINE = AccessLine("fiber", rtt_ms=5.0, up_mbps=8.0, down_mbps=8.0)
HOME = Site("us-east", LINE)
FAR = Site("asia-east", LINE)


def node(node_id: str, site: Site = HOME, gpu: GpuSpec = TOY_GPU) -> SimNode:
    return SimNode(node_id, gpu, site)


def swarm(*nodes: SimNode, model: ModelShape = TOY, params: ServingParams = EXACT) -> Swarm:
    return Swarm.of(model, params, nodes)


def toy_model(layers: int) -> ModelShape:
    """The toy layer shape, `layers` deep."""
    return ModelShape(
        f"toy{layers}",
        num_layers=layers,
        hidden=1024,
        intermediate=2048,
        heads=8,
        kv_heads=8,
        vocab=1000,
    )


PER_LAYER_BYTES = 20_975_616 + 2048 * 4096  # weights + KV for 2048 tokens (EXACT params)


def gpu_holding(layers: float, memory_gbps: float = 100.0, name: str = "") -> GpuSpec:
    """A card whose budget (after the probe's 0.5 GiB and the planner's 10 % headroom) fits
    `layers` toy layers; pass x.5 to land safely between two whole numbers."""
    gib = 1024**3
    total = 0.5 * gib + layers * PER_LAYER_BYTES / 0.9
    return GpuSpec(name or f"holds-{layers}", total / gib, 1.0, memory_gbps)
