"""What this machine can offer: device, memory, and the dtypes it computes in.

torch is imported only when needed, so `--help` and the CPU facts work without it.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

GIB = 1024**3

# Memory the agent leaves alone. A GPU needs room for the CUDA context and allocator
# fragmentation; a PC's RAM must still run its owner's desktop.
_CUDA_HEADROOM_FRACTION = 0.10
_CUDA_HEADROOM_MIN = GIB // 2
_RAM_HEADROOM_FRACTION = 0.20
_RAM_HEADROOM_MIN = 2 * GIB


class DeviceError(Exception):
    """The requested device does not exist here. The message says what does."""


@dataclass(frozen=True)
class HardwareInfo:
    device_kind: str  # "cuda" | "mps" | "cpu"
    torch_device: str  # what the runtime passes to torch, e.g. "cuda:1"
    device_name: str
    device_count: int  # GPUs on the machine, 0 when CPU-only
    memory_total_bytes: int
    memory_usable_bytes: int
    compute_capability: str
    cpu_cores: int
    ram_bytes: int
    dtypes: tuple[str, ...] = field(default=("float32",))


def probe(device: str = "auto", max_memory_gb: float | None = None) -> HardwareInfo:
    """Probe `device` ("auto", "cpu", "cuda", "cuda:N" or "mps")."""
    kind, index = _parse_device(device)
    ram = total_ram_bytes()
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if kind == "auto":
        kind, index = _auto_device()
    if kind == "cuda":
        return _probe_cuda(index, ram, cores, max_memory_gb)
    if kind == "mps":
        return _probe_mps(ram, cores, max_memory_gb)
    return HardwareInfo(
        device_kind="cpu",
        torch_device="cpu",
        device_name=cpu_model_name(),
        device_count=_cuda_count_quietly(),
        memory_total_bytes=ram,
        memory_usable_bytes=usable_bytes(
            ram, _RAM_HEADROOM_FRACTION, _RAM_HEADROOM_MIN, max_memory_gb
        ),
        compute_capability="",
        cpu_cores=cores,
        ram_bytes=ram,
        # float16 matmuls on CPU are emulated and many times slower than float32; offering
        # it would only lure the planner into a slow layout.
        dtypes=("float32", "bfloat16"),
    )


def usable_bytes(
    total: int, headroom_fraction: float, headroom_min: int, max_memory_gb: float | None
) -> int:
    usable = max(0, total - max(int(total * headroom_fraction), headroom_min))
    if max_memory_gb is not None:
        usable = min(usable, int(max_memory_gb * GIB))
    return usable


def total_ram_bytes() -> int:
    """Physical RAM, or the container's cgroup limit when that is lower."""
    ram = psutil.virtual_memory().total
    limit = _cgroup_memory_limit()
    return min(ram, limit) if limit else ram


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _parse_device(device: str) -> tuple[str, int]:
    text = device.strip().lower()
    if text in ("auto", "cpu", "mps"):
        return text, 0
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match:
        return "cuda", int(match.group(1) or 0)
    raise DeviceError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps")


def _auto_device() -> tuple[str, int]:
    torch = _import_torch()
    if torch is None:
        return "cpu", 0
    if torch.cuda.is_available():
        return "cuda", 0
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps", 0
    return "cpu", 0


def _probe_cuda(index: int, ram: int, cores: int, max_memory_gb: float | None) -> HardwareInfo:
    from node_agent.runtime.dtypes import cuda_supports_bf16

    torch = _import_torch()
    if torch is None or not torch.cuda.is_available():
        raise DeviceError(
            "CUDA was requested but torch sees no CUDA GPU here; install a CUDA build of torch "
            "(https://pytorch.org/get-started/locally/) or use --device cpu"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"there is no cuda:{index}; this machine has {count} GPU(s): cuda:0..")
    props = torch.cuda.get_device_properties(index)
    total = int(props.total_memory)
    dtypes = ["float32", "float16"]
    # Not torch.cuda.is_bf16_supported(): it says yes for pre-Ampere GPUs, which only
    # emulate bf16. The coordinator gives bf16 to any node that claims it, and the runtime
    # refuses bf16 there, so a T4 claiming it could never load a shard.
    if cuda_supports_bf16(torch.device("cuda", index)):
        dtypes.append("bfloat16")
    return HardwareInfo(
        device_kind="cuda",
        torch_device=f"cuda:{index}",
        device_name=str(props.name),
        device_count=count,
        memory_total_bytes=total,
        memory_usable_bytes=usable_bytes(
            total, _CUDA_HEADROOM_FRACTION, _CUDA_HEADROOM_MIN, max_memory_gb
        ),
        compute_capability=f"{props.major}.{props.minor}",
        cpu_cores=cores,
        ram_bytes=ram,
        dtypes=tuple(dtypes),
    )


def _probe_mps(ram: int, cores: int, max_memory_gb: float | None) -> HardwareInfo:
    torch = _import_torch()
    mps = getattr(torch.backends, "mps", None) if torch is not None else None
    if mps is None or not mps.is_available():
        raise DeviceError("MPS was requested but this torch has no Metal support; use --device cpu")
    # Apple silicon shares RAM between CPU and GPU, so the RAM rules apply.
    return HardwareInfo(
        device_kind="mps",
        torch_device="mps",
        device_name=f"Apple GPU ({cpu_model_name()})",
        device_count=1,
        memory_total_bytes=ram,
        memory_usable_bytes=usable_bytes(
            ram, _RAM_HEADROOM_FRACTION, _RAM_HEADROOM_MIN, max_memory_gb
        ),
        compute_capability="",
        cpu_cores=cores,
        ram_bytes=ram,
        dtypes=("float32", "float16"),
    )


def _cuda_count_quietly() -> int:
    # A CPU node on a GPU machine still says how many GPUs it left unused.
    torch = _import_torch()
    try:
        return torch.cuda.device_count() if torch is not None and torch.cuda.is_available() else 0
    except RuntimeError:
        return 0


@functools.cache
def _import_torch():  # noqa: ANN202 - torch is an optional import; its module type is Any
    try:
        import torch
    except ImportError:
        log.warning(
            "torch is not installed; install the node extra: pip install 'tessera-swarm[node]'"
        )
        return None
    return torch


def _cgroup_memory_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # cgroup v1 writes a huge number for "none"
            return int(text)
    return None
