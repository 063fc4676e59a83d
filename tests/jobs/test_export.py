"""Turning a job's checkpoint into a model: dtype conversions and what export refuses.

Real Hugging Face checkpoints are mostly bf16 or fp16, while stages train and checkpoint in
fp32, so every trained tensor is cast back to its base model's dtype here (numpy, no
torch on the coordinator). torch, a test-only dependency, is the reference for bf16.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from coordinator.jobs.export import (
    PARAM_PREFIX,
    TRAINING_METADATA_KEY,
    StagePart,
    decode,
    encode,
    trained_tensors,
)
from coordinator.model_store.catalog import TensorRecord
from coordinator.model_store.errors import StoreError

TRAINED = "model.layers.0.mlp.up_proj.weight"
KEPT = "model.layers.0.mlp.down_proj.weight"


def torch_bf16_bits(values: np.ndarray) -> bytes:
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def awkward_floats() -> np.ndarray:
    """Random values of every magnitude, plus exact ties of bf16 rounding both ways."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal(4096).astype(np.float32) * np.float32(10.0) ** rng.integers(
        -30, 30, 4096
    ).astype(np.float32)
    ties = (np.arange(64, dtype=np.uint32) << 16 | 0x3F800000 | 0x8000).view(np.float32)
    edges = np.array([0.0, -0.0, 1e-40, -1e-40, 3.3e38, -3.3e38, 65504.0], dtype=np.float32)
    return np.concatenate([values, ties, -ties, edges])


def test_bf16_encoding_rounds_to_nearest_even_as_torch_does() -> None:
    values = awkward_floats()
    assert encode(values, "BF16") == torch_bf16_bits(values)


def test_bf16_decoding_matches_torch() -> None:
    bits = torch_bf16_bits(awkward_floats())
    expected = torch.frombuffer(bytearray(bits), dtype=torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(decode(bits, "BF16", (len(expected),)), expected)


def test_f16_and_f32_round_trip() -> None:
    values = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    np.testing.assert_array_equal(decode(encode(values, "F32"), "F32", (8, 16)), values)
    halves = decode(encode(values, "F16"), "F16", (8, 16))
    np.testing.assert_array_equal(halves, values.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("convert", [lambda: encode(np.zeros(2), "I8"),
                                     lambda: decode(b"\0\0", "I8", (2,))])  # fmt: skip
def test_a_dtype_export_cannot_convert_is_refused(convert: object) -> None:
    with pytest.raises(StoreError) as caught:
        convert()  # type: ignore[operator]
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "I8" in caught.value.message


class BaseModel:
    """Two tensors of a base model in ``dtype``, as blobs named by their digest."""

    def __init__(self, folder: Path, dtype: str) -> None:
        self.folder = folder
        self.records = [self._blob(TRAINED, dtype), self._blob(KEPT, dtype)]

    def _blob(self, name: str, dtype: str) -> TensorRecord:
        data = encode(np.full((4, 8), 0.5, dtype=np.float32), dtype)
        digest = hashlib.sha256(data).hexdigest()
        (self.folder / digest).write_bytes(data)
        return TensorRecord(name, digest, dtype, (4, 8), len(data), 0)

    def path(self, digest: str) -> Path:
        return self.folder / digest


def stage_part(folder: Path, weight: np.ndarray) -> StagePart:
    """A stage's checkpoint of layer 0 as nodes write it: fp32 `param/` tensors plus the
    training metadata."""
    path = folder / "part.safetensors"
    info = {"start": 0, "end": 1, "mode": "full"}
    save_file({f"{PARAM_PREFIX}{TRAINED}": weight}, str(path),
              metadata={TRAINING_METADATA_KEY: json.dumps(info)})  # fmt: skip
    return StagePart(path, 0, 1)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_a_trained_tensor_is_stored_in_its_base_dtype(tmp_path: Path, dtype: str) -> None:
    base = BaseModel(tmp_path, dtype)
    weight = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    trained, kept = trained_tensors(base.records, base.path, [stage_part(tmp_path, weight)])

    assert trained.data == encode(weight, dtype)
    assert trained.record.dtype == dtype and trained.record.shape == (4, 8)
    assert trained.record.sha256 == hashlib.sha256(trained.data).hexdigest()
    assert trained.record.nbytes == len(trained.data)
    # What no stage trained is the base model's blob, shared, not a copy.
    assert kept.data is None and kept.base_path == base.path(base.records[1].sha256)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_weights_that_are_not_finite_are_refused(tmp_path: Path, bad: float) -> None:
    base = BaseModel(tmp_path, "BF16")
    weight = np.ones((4, 8), dtype=np.float32)
    weight[2, 3] = bad
    with pytest.raises(StoreError) as caught:
        trained_tensors(base.records, base.path, [stage_part(tmp_path, weight)])
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert TRAINED in caught.value.message and "NaN or inf" in caught.value.message
    assert "train again" in caught.value.message


def test_weights_beyond_the_base_dtype_are_refused(tmp_path: Path) -> None:
    base = BaseModel(tmp_path, "F16")
    weight = np.ones((4, 8), dtype=np.float32)
    weight[0, 0] = 70000.0  # fp32 holds it; fp16 would store inf
    with pytest.raises(StoreError) as caught:
        trained_tensors(base.records, base.path, [stage_part(tmp_path, weight)])
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert TRAINED in caught.value.message and "F16" in caught.value.message
    # The same weight fits a bf16 base model.
    (tmp_path / "bf16").mkdir()
    bf16 = BaseModel(tmp_path / "bf16", "BF16")
    trained, _ = trained_tensors(bf16.records, bf16.path, [stage_part(tmp_path, weight)])
    assert decode(trained.data or b"", "BF16", (4, 8))[0, 0] == 70144.0  # nearest bf16
