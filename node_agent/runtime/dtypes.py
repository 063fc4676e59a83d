"""Choosing the compute dtype for a device."""

from __future__ import annotations

import logging
import os

import torch

from node_agent.runtime.errors import UnsupportedDtypeError

log = logging.getLogger(__name__)

# Set, it makes torch run fp32 matmuls on TF32 tensor cores whatever the flags say.
TF32_OVERRIDE_ENV = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(requested: torch.dtype | str | None) -> torch.dtype | None:
    """Accept a torch dtype, a common name ("bf16", "float16", ...) or None/"auto"."""
    if requested is None or isinstance(requested, torch.dtype):
        return requested
    name = requested.strip().lower().removeprefix("torch.")
    if name == "auto":
        return None
    if name not in _DTYPE_ALIASES:
        raise UnsupportedDtypeError(
            f"unknown dtype {requested!r}; use one of fp32, fp16, bf16 or auto"
        )
    return _DTYPE_ALIASES[name]


def resolve_dtype(
    device: str | torch.device, requested: torch.dtype | str | None = None
) -> torch.dtype:
    """Pick (or validate) the compute dtype: fp32 on CPU, bf16 (else fp16) on CUDA.

    Half precision is refused on CPU: CPU kernels for it are slow or missing, and the
    swarm's reference numerics for CPU nodes are fp32.
    """
    dev = torch.device(device)
    dtype = parse_dtype(requested)
    if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise UnsupportedDtypeError(f"dtype {dtype} is not supported; use fp32, fp16 or bf16")
    if dev.type == "cpu":
        if dtype not in (None, torch.float32):
            raise UnsupportedDtypeError(
                f"{dtype} is not supported on CPU; use float32 there, or run on a CUDA GPU "
                "for fp16/bf16"
            )
        return torch.float32
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedDtypeError(f"device {dev} requested but CUDA is not available")
        bf16_ok = cuda_supports_bf16(dev)
        if dtype is None:
            return torch.bfloat16 if bf16_ok else torch.float16
        if dtype == torch.bfloat16 and not bf16_ok:
            raise UnsupportedDtypeError(
                f"{dev} has no native bfloat16 support (needs compute capability 8.0+); "
                "use fp16 instead"
            )
        return dtype
    raise UnsupportedDtypeError(f"device type {dev.type!r} is not supported; use cpu or cuda")


def cuda_supports_bf16(device: torch.device) -> bool:
    """Native bf16 on this GPU: what the node may claim and the coordinator may assign."""
    if torch.version.hip:
        return torch.cuda.is_bf16_supported()
    # Pre-Ampere GPUs only emulate bf16, far slower than fp16, so it does not count.
    return torch.cuda.get_device_capability(device) >= (8, 0)


def pin_full_fp32() -> None:
    """Make this process's fp32 matmuls full fp32 on CUDA, whatever the environment asked.

    TF32 keeps 10 mantissa bits of each matmul input. On an H200 it put 1.4e-3 of relative
    error into an fp32 stage's output (bench/cuda_check.py), above the 1e-3 that checks
    allow an fp32 node: an honest node computing in TF32 while it claims fp32 would be
    convicted. torch reads the override variable once, at the first matmul it runs, so the
    node calls this before any GPU work.
    """
    if os.environ.pop(TF32_OVERRIDE_ENV, "0").strip() not in ("", "0"):
        log.warning(
            "ignoring %s: a node computes fp32 in full precision, since TF32's rounding would "
            "fail the checks that compare its results with other nodes'",
            TF32_OVERRIDE_ENV,
        )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
