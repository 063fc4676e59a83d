"""Real consumer and workstation GPUs, with the numbers their vendor publishes.

Sources (vendor spec sheets and architecture whitepapers):
  * NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix tables (RTX 3070/3080/3090):
    memory, memory bandwidth, "Peak FP16 Tensor TFLOPS with FP32 Accumulate".
  * NVIDIA Ada GPU Architecture whitepaper (RTX 4090) and the RTX 4060 Ti / 4070 product
    pages (memory, bandwidth, AI TOPS; dense FP16 with FP32 accumulate is AI TOPS / 8 for
    GeForce Ada, whose FP32-accumulate rate is half the FP16-accumulate rate).
  * RTX 3060 product page (12 GB, 360 GB/s; 101 sparse FP16 tensor TFLOPS -> 25.5 dense
    with FP32 accumulate).
  * NVIDIA RTX A4000 datasheet (16 GB, 448 GB/s, 153.4 sparse tensor TFLOPS -> 76.7 dense;
    workstation cards accumulate in FP32 at full rate).

`fp16_tflops` is the dense FP16 tensor-core rate with FP32 accumulation, because that is
what PyTorch's half-precision matmuls run at; sparse and FP16-accumulate figures are 2x
and 4x larger and no inference stack here reaches them.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    fp16_tflops: float  # dense tensor, FP32 accumulate
    memory_gbps: float  # GB/s (10^9 bytes)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("RTX 3060 12GB", 12, 25.5, 360),
        GpuSpec("RTX 3070 8GB", 8, 40.6, 448),
        GpuSpec("RTX 3080 10GB", 10, 59.5, 760),
        GpuSpec("RTX 3090 24GB", 24, 71.0, 936),
        GpuSpec("RTX 4060 Ti 16GB", 16, 44.1, 288),
        GpuSpec("RTX 4070 12GB", 12, 58.3, 504),
        GpuSpec("RTX 4090 24GB", 24, 165.2, 1008),
        GpuSpec("RTX A4000 16GB", 16, 76.7, 448),
    )
}

# Mixes: relative frequency of each card in a swarm. "steam" follows the ordering of the
# Steam hardware survey (3060 most common, 4090/A4000 rare); the weights are ours.
MIXES: dict[str, dict[str, float]] = {
    "steam": {
        "RTX 3060 12GB": 0.26,
        "RTX 3070 8GB": 0.16,
        "RTX 3080 10GB": 0.12,
        "RTX 3090 24GB": 0.08,
        "RTX 4060 Ti 16GB": 0.12,
        "RTX 4070 12GB": 0.14,
        "RTX 4090 24GB": 0.08,
        "RTX A4000 16GB": 0.04,
    },
    "high-end": {
        "RTX 3090 24GB": 0.35,
        "RTX 4090 24GB": 0.35,
        "RTX A4000 16GB": 0.15,
        "RTX 4060 Ti 16GB": 0.15,
    },
    "low-memory": {
        "RTX 3060 12GB": 0.35,
        "RTX 3070 8GB": 0.30,
        "RTX 3080 10GB": 0.20,
        "RTX 4070 12GB": 0.15,
    },
}
