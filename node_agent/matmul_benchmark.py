"""Measure what this device really computes, instead of trusting a spec sheet.

A square matmul in the dtype the node would serve in (float32 on CPU, float16 on a GPU),
and a large copy for memory bandwidth. The coordinator's planner turns both into a layer's
decode time (the slower of compute and streaming the weights), so a slow or busy machine
gets proportionally less work until measured traffic takes over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 0.5


def measure_tflops(torch_device: str = "cpu", budget_s: float = DEFAULT_BUDGET_S) -> float:
    """Matmul TFLOPS on `torch_device`, measured for about `budget_s` seconds."""
    try:
        import torch
    except ImportError:
        log.warning("torch is not installed; measuring a float32 numpy matmul instead")
        return _numpy_tflops(budget_s)
    device = torch.device(torch_device)
    if device.type == "cuda":
        return _torch_tflops(torch, device, torch.float16, n=4096, budget_s=budget_s)
    if device.type == "mps":
        return _torch_tflops(torch, device, torch.float16, n=2048, budget_s=budget_s)
    return _torch_tflops(torch, device, torch.float32, n=1024, budget_s=budget_s)


def measure_bandwidth_gbps(torch_device: str = "cpu", budget_s: float = DEFAULT_BUDGET_S) -> float:
    """Memory bandwidth on `torch_device` in GB/s (bytes read plus written), copying a buffer
    far larger than any cache for about `budget_s` seconds; 0.0 without torch.

    Decode at batch 1 reads every weight once per token: on a GPU this, not the matmul
    rate, decides the speed (an RTX 3090 does 71 fp16 TFLOP/s but streams ~900 GB/s)."""
    try:
        import torch
    except ImportError:
        return 0.0
    device = torch.device(torch_device)
    size = (256 if device.type in ("cuda", "mps") else 64) * 2**20
    # A plain copy runs at the same speed whatever the bytes are; filling the buffer with
    # random ones would take longer than the measurement.
    source = torch.full((size,), 0x5A, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copies, elapsed = _timed(lambda: target.copy_(source), _synchronizer(torch, device), budget_s)
    return 2.0 * size * copies / elapsed / 1e9


def _torch_tflops(torch, device, dtype, n: int, budget_s: float) -> float:  # noqa: ANN001
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    with torch.inference_mode():
        products, elapsed = _timed(
            lambda: torch.matmul(a, b, out=out), _synchronizer(torch, device), budget_s
        )
    return 2.0 * n**3 * products / elapsed / 1e12


def _synchronizer(torch, device) -> Callable[[], None]:  # noqa: ANN001
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def _timed(
    op: Callable[[], object], sync: Callable[[], None], budget_s: float
) -> tuple[int, float]:
    """Run `op` for about `budget_s` seconds: (how many times, seconds it took)."""
    # The first calls pay for kernel selection and clock ramp-up; they are not throughput.
    for _ in range(2):
        op()
    sync()
    iterations = 0
    start = time.perf_counter()
    elapsed = 0.0
    while elapsed < budget_s:
        # Batches between clock reads keep the timer's cost out of fast GPU runs.
        for _ in range(4):
            op()
        sync()
        iterations += 4
        elapsed = time.perf_counter() - start
    return iterations, elapsed


def _numpy_tflops(budget_s: float, n: int = 512) -> float:
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    a @ b
    iterations = 0
    start = time.perf_counter()
    elapsed = 0.0
    while elapsed < budget_s:
        a @ b
        iterations += 1
        elapsed = time.perf_counter() - start
    return 2.0 * n**3 * iterations / elapsed / 1e12
