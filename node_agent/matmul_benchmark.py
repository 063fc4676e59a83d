"""Measure what this device really computes, instead of trusting a spec sheet.

A square matmul in the dtype the node would serve in: float32 on CPU, float16 on a GPU.
The coordinator's planner turns the result into layer throughput, so a slow or busy
machine gets proportionally less work.
"""

from __future__ import annotations

import logging
import time

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


def _torch_tflops(torch, device, dtype, n: int, budget_s: float) -> float:  # noqa: ANN001
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()

    # The first calls pay for kernel selection and clock ramp-up; they are not throughput.
    for _ in range(2):
        torch.matmul(a, b, out=out)
    sync()
    iterations = 0
    start = time.perf_counter()
    elapsed = 0.0
    with torch.inference_mode():
        while elapsed < budget_s:
            # Batches between clock reads keep the timer's cost out of fast GPU runs.
            for _ in range(4):
                torch.matmul(a, b, out=out)
            sync()
            iterations += 4
            elapsed = time.perf_counter() - start
    return 2.0 * n**3 * iterations / elapsed / 1e12


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
