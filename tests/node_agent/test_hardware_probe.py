"""The probe reports sane numbers for this machine and honours the owner's memory cap."""

import os
from types import SimpleNamespace

import psutil
import pytest

from node_agent import hardware_probe
from node_agent.hardware_probe import GIB, DeviceError, probe, usable_bytes


def test_cpu_probe_is_sane() -> None:
    hw = probe("cpu")
    assert hw.device_kind == "cpu"
    assert hw.torch_device == "cpu"
    assert hw.device_name and hw.device_name != "unknown CPU"
    assert 1 <= hw.cpu_cores <= (os.cpu_count() or 1)
    assert 0 < hw.ram_bytes <= psutil.virtual_memory().total
    assert hw.memory_total_bytes == hw.ram_bytes
    assert 0 <= hw.memory_usable_bytes < hw.memory_total_bytes
    assert hw.compute_capability == ""
    assert "float32" in hw.dtypes and "float16" not in hw.dtypes


def test_auto_picks_a_device_that_exists() -> None:
    """A CUDA GPU first, then Apple's MPS, else the CPU: whichever this machine has."""
    import torch

    mps = getattr(torch.backends, "mps", None)
    expected = (
        "cuda"
        if torch.cuda.is_available()
        else "mps"
        if mps is not None and mps.is_available()
        else "cpu"
    )
    assert probe("auto").device_kind == expected


def test_the_owner_cap_limits_usable_memory() -> None:
    assert probe("cpu", max_memory_gb=0.5).memory_usable_bytes == GIB // 2


def test_usable_memory_leaves_headroom_and_never_goes_negative() -> None:
    assert usable_bytes(10 * GIB, 0.2, 2 * GIB, None) == 8 * GIB
    assert usable_bytes(100 * GIB, 0.2, 2 * GIB, None) == 80 * GIB
    assert usable_bytes(1 * GIB, 0.2, 2 * GIB, None) == 0
    assert usable_bytes(100 * GIB, 0.2, 2 * GIB, 4) == 4 * GIB


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu", ""])
def test_unknown_devices_are_named_in_the_error(device: str) -> None:
    with pytest.raises(DeviceError, match="use auto, cpu, cuda, cuda:N or mps"):
        probe(device)


def test_a_missing_cuda_gpu_is_a_clear_error() -> None:
    import torch

    if torch.cuda.is_available():
        with pytest.raises(DeviceError, match="there is no cuda:99"):
            probe("cuda:99")
    else:
        with pytest.raises(DeviceError, match="--device cpu"):
            probe("cuda")


def test_cpu_model_name_is_a_single_clean_line() -> None:
    name = hardware_probe.cpu_model_name()
    assert name and "\n" not in name and name == name.strip()


@pytest.mark.parametrize(
    ("name", "capability", "claims_bf16"),
    [("Tesla T4", (7, 5), False), ("NVIDIA A100", (8, 0), True), ("NVIDIA H200", (9, 0), True)],
)
def test_only_gpus_with_native_bf16_claim_it(monkeypatch, name, capability, claims_bf16) -> None:
    # No GPU here: torch's CUDA queries answer as the named card would. torch says bf16 is
    # supported even on a T4 (it emulates it), which is exactly what the probe must not trust.
    import torch

    props = SimpleNamespace(
        name=name, total_memory=16 * GIB, major=capability[0], minor=capability[1]
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.version, "hip", None)
    hw = probe("cuda")
    assert hw.device_name == name and hw.compute_capability == f"{capability[0]}.{capability[1]}"
    assert ("bfloat16" in hw.dtypes) is claims_bf16
    assert "float16" in hw.dtypes
