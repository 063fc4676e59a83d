"""Turn a job's final consistent checkpoint into a new model in the store (--output-model).

Each stage's checkpoint part is a safetensors file (node_agent/runtime/training.py,
format "tessera-stage-training/1") holding its trainable parameters as `param/<name>`, plus
AdamW state that export ignores. Names are the Hugging Face names of the base model, so:

* full mode: every `param/<hf name>` replaces that tensor of the base model;
* LoRA mode: `param/<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r] are merged
  into the base weight as W + (alpha / r) * B @ A, in fp32 (numpy; the coordinator has no
  torch), then cast to the base tensor's dtype.

Tensors no stage trained keep their blob: the new model shares them with the base model.
The result goes through the model store's own import, which checks every tensor against
the architecture like any upload.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.model_store.catalog import TensorRecord
from coordinator.model_store.errors import CheckpointError, invalid
from coordinator.model_store.safetensors_format import TensorSpan, read_header
from protos.tessera.v1 import admin_pb2

TRAINING_METADATA_KEY = "tessera_training"
PARAM_PREFIX = "param/"
_CHUNK = 4 << 20

BlobPath = Callable[[str], Path]  # sha256 -> the model store's file for it


@dataclass(frozen=True)
class StagePart:
    path: Path  # the part's blob
    start: int
    end: int


@dataclass
class NewTensor:
    record: TensorRecord
    data: bytes | None  # None: the base model's blob is reused as is
    base_path: Path | None = None


def read_fp32(span: TensorSpan) -> np.ndarray:
    raw = np.fromfile(span.path, dtype=np.uint8, count=span.nbytes, offset=span.offset)
    return decode(raw.tobytes(), span.dtype, span.shape)


def decode(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "F32":
        return np.frombuffer(data, dtype="<f4").reshape(shape).copy()
    if dtype == "F16":
        return np.frombuffer(data, dtype="<f2").astype(np.float32).reshape(shape)
    if dtype == "BF16":
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    raise invalid(f"cannot decode tensors of dtype {dtype}")


def encode(array: np.ndarray, dtype: str) -> bytes:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "F32":
        return array.astype("<f4").tobytes()
    if dtype == "F16":
        return array.astype("<f2").tobytes()
    if dtype == "BF16":
        bits = array.view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        return rounded.astype("<u2").tobytes()
    raise invalid(f"cannot encode tensors as {dtype}")


# The largest finite value of each narrow dtype; past it a weight rounds to inf or to a
# value nobody trained.
_LARGEST = {"F16": 65504.0, "BF16": 3.3895313892515355e38}


def _require_representable(name: str, array: np.ndarray, dtype: str) -> None:
    """Refuse weights the new model could not compute with: checkpoint parts come from
    nodes, and a NaN or an overflow in a stored weight would only show up later, as every
    node serving the model failing its output checks."""
    if not np.isfinite(array).all():
        raise invalid(
            f"the trained {name} holds NaN or inf values, so it cannot become a model (a "
            "stage's checkpoint is corrupt, or training diverged); train again from the base "
            "model, perhaps with a lower learning rate"
        )
    largest = _LARGEST.get(dtype)
    if largest is not None and array.size and float(np.abs(array).max()) > largest:
        raise invalid(
            f"the trained {name} has values up to {float(np.abs(array).max()):.4g}, beyond "
            f"what the base model's {dtype} holds (±{largest:.4g}); train again from the "
            "base model, perhaps with a lower learning rate"
        )


def trained_tensors(
    base: list[TensorRecord], base_path: BlobPath, parts: list[StagePart]
) -> list[NewTensor]:
    """The new model's tensors, in the base model's order."""
    by_name = {t.name: t for t in base}
    updates: dict[str, np.ndarray] = {}
    for part in parts:
        try:
            header = read_header(part.path)
        except CheckpointError as err:
            raise invalid(
                f"checkpoint of layers [{part.start}, {part.end}) is unreadable: {err}"
            ) from None
        info = _training_info(header.metadata, part)
        params = {
            name.removeprefix(PARAM_PREFIX): span
            for name, span in header.tensors.items()
            if name.startswith(PARAM_PREFIX)
        }
        if info.get("mode") == "lora":
            _merge_lora(params, info, by_name, base_path, updates, part)
        else:
            for name, span in params.items():
                base_tensor = by_name.get(name)
                if base_tensor is None or tuple(span.shape) != base_tensor.shape:
                    raise invalid(
                        f"checkpoint of layers [{part.start}, {part.end}) has parameter {name} "
                        f"{list(span.shape)}, which the base model does not have"
                    )
                if name in updates:
                    raise invalid(f"two stages trained {name}; the checkpoint is inconsistent")
                updates[name] = read_fp32(span)
    out: list[NewTensor] = []
    for t in base:
        if t.name not in updates:
            out.append(NewTensor(t, None, base_path(t.sha256)))
            continue
        _require_representable(t.name, updates[t.name], t.dtype)
        data = encode(updates[t.name], t.dtype)
        digest = hashlib.sha256(data).hexdigest()
        out.append(
            NewTensor(TensorRecord(t.name, digest, t.dtype, t.shape, len(data), t.layer), data)
        )
    return out


def _training_info(metadata: dict[str, str], part: StagePart) -> dict[str, object]:
    try:
        info = json.loads(metadata.get(TRAINING_METADATA_KEY, ""))
    except json.JSONDecodeError:
        info = None
    if not isinstance(info, dict):
        raise invalid(
            f"checkpoint of layers [{part.start}, {part.end}) lacks its training metadata"
        )
    if (info.get("start"), info.get("end")) != (part.start, part.end):
        raise invalid(
            f"checkpoint of layers [{part.start}, {part.end}) says it holds layers "
            f"[{info.get('start')}, {info.get('end')})"
        )
    return info


def _merge_lora(
    params: dict[str, TensorSpan],
    info: dict[str, object],
    by_name: dict[str, TensorRecord],
    base_path: BlobPath,
    updates: dict[str, np.ndarray],
    part: StagePart,
) -> None:
    rank, alpha = info.get("lora_rank"), info.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise invalid(f"LoRA checkpoint of layers [{part.start}, {part.end}) lacks rank/alpha")
    scale = float(alpha) / rank
    modules = {n.removesuffix(".lora_A.weight") for n in params if n.endswith(".lora_A.weight")}
    for module in sorted(modules):
        a_span, b_span = (
            params.get(f"{module}.lora_A.weight"),
            params.get(f"{module}.lora_B.weight"),
        )
        base = by_name.get(f"{module}.weight")
        if a_span is None or b_span is None or base is None:
            raise invalid(f"LoRA checkpoint has an incomplete adapter for {module}")
        a, b = read_fp32(a_span), read_fp32(b_span)
        if a.shape != (rank, base.shape[1]) or b.shape != (base.shape[0], rank):
            raise invalid(
                f"LoRA adapter of {module} does not fit its base weight {list(base.shape)}"
            )
        raw = Path(base_path(base.sha256)).read_bytes()
        updates[base.name] = decode(raw, base.dtype, base.shape) + scale * (b @ a)


async def import_messages(
    name: str, config_json: str, tokenizer_json: bytes, tensors: list[NewTensor]
) -> AsyncIterator[admin_pb2.AddModelChunk]:
    """An AddModel stream for the model store's importer."""
    yield admin_pb2.AddModelChunk(
        header=admin_pb2.AddModelHeader(
            name=name,
            config_json=config_json,
            tokenizer_json=tokenizer_json,
            tensors=[
                admin_pb2.TensorHeader(
                    name=t.record.name,
                    dtype=t.record.dtype,
                    shape=list(t.record.shape),
                    nbytes=t.record.nbytes,
                    sha256=t.record.sha256,
                )
                for t in tensors
            ],
        )
    )
    for t in tensors:
        offset = 0
        for chunk in _chunks(t):
            yield admin_pb2.AddModelChunk(
                data=admin_pb2.TensorData(name=t.record.name, offset=offset, data=chunk)
            )
            offset += len(chunk)


def _chunks(t: NewTensor) -> Iterator[bytes]:
    if t.data is not None:
        for i in range(0, len(t.data), _CHUNK):
            yield t.data[i : i + _CHUNK]
        return
    assert t.base_path is not None, "an untrained tensor keeps its base blob"
    with t.base_path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            yield chunk
