"""Open a local Hugging Face style checkpoint directory and check it fully, without torch.

A directory holds `config.json`, either `model.safetensors` or `model.safetensors.index.json`
plus the shards it names, and optionally `tokenizer.json`. Pickle weights are refused:
whoever loads them runs whatever code they carry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.model_store.errors import CheckpointError
from coordinator.model_store.layout import ModelLayout, check_tensor, layer_of
from coordinator.model_store.safetensors_format import SafetensorsHeader, TensorSpan, read_header

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

MAX_CONFIG_BYTES = 1 << 20
# The tokenizer travels inside the AddModel header message, which is capped at 64 MiB.
MAX_TOKENIZER_BYTES = 32 << 20
READ_CHUNK_BYTES = 4 << 20
_MAX_NAMES_SHOWN = 8


@dataclass(frozen=True)
class CheckpointTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    layer: int
    path: Path
    offset: int

    def iter_bytes(self, chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[bytes]:
        """The raw tensor bytes from the file, in chunks."""
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            left = self.nbytes
            while left:
                chunk = handle.read(min(chunk_bytes, left))
                if not chunk:
                    raise CheckpointError(f"{self.path} ended inside tensor {self.name}")
                left -= len(chunk)
                yield chunk

    def sha256(self, on_bytes: Callable[[int], None] | None = None) -> str:
        digest = hashlib.sha256()
        for chunk in self.iter_bytes():
            digest.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
        return digest.hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    directory: Path
    config_json: str
    layout: ModelLayout
    tokenizer_json: bytes
    tensors: list[CheckpointTensor]  # exactly what the architecture needs, in layout order
    ignored: list[str] = field(default_factory=list)  # present in the files, not needed

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def open_checkpoint(directory: str | Path) -> Checkpoint:
    """Validate `directory` and describe every tensor to upload; CheckpointError otherwise."""
    root = Path(directory)
    if not root.is_dir():
        what = "is a file" if root.exists() else "does not exist"
        raise CheckpointError(
            f"checkpoint directory {root} {what}; give the directory that holds config.json "
            "and the *.safetensors files"
        )
    config_json = _read_config(root)
    spans = _all_spans(root)  # first: "convert your pickle" matters more than config details
    layout = ModelLayout.from_config(json.loads(config_json))
    expected = layout.expected_shapes()
    missing = [name for name in expected if name not in spans]
    if missing:
        raise CheckpointError(
            f"{root} lacks {len(missing)} tensor(s) that {layout.architecture} with "
            f"{layout.num_layers} layers needs: {_names(missing)}"
        )
    tensors = []
    for name, shape in expected.items():
        span = spans[name]
        try:
            check_tensor(name, span.dtype, span.shape, shape)
        except CheckpointError as err:
            raise CheckpointError(f"{span.path}: {err}") from None
        tensors.append(
            CheckpointTensor(
                name, span.dtype, span.shape, span.nbytes, layer_of(name), span.path, span.offset
            )
        )
    return Checkpoint(
        directory=root,
        config_json=config_json,
        layout=layout,
        tokenizer_json=_read_tokenizer(root),
        tensors=tensors,
        ignored=sorted(set(spans) - set(expected)),
    )


def _read_config(root: Path) -> str:
    path = root / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found; a checkpoint directory needs a config.json")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_CONFIG_BYTES} bytes; is it a config?")
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    return text


def _read_tokenizer(root: Path) -> bytes:
    path = root / TOKENIZER_FILE
    if not path.is_file():
        return b""
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise CheckpointError(f"{path} is larger than the limit of {MAX_TOKENIZER_BYTES} bytes")
    data = path.read_bytes()
    try:
        json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    return data


def _all_spans(root: Path) -> dict[str, TensorSpan]:
    index = root / INDEX_FILE
    if index.is_file():
        return _spans_from_index(root, index)
    single = root / SINGLE_FILE
    if single.is_file():
        return read_header(single).tensors
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{root} only has pickle weights ({', '.join(pickles[:3])}), which Tessera refuses "
            "because loading pickle can run arbitrary code. Convert the checkpoint to "
            "safetensors first, e.g. AutoModelForCausalLM.from_pretrained(src)"
            ".save_pretrained(dst, safe_serialization=True)."
        )
    raise CheckpointError(f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def _spans_from_index(root: Path, index_path: Path) -> dict[str, TensorSpan]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{index_path} is not valid JSON: {err}") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path} has no 'weight_map' object")
    headers: dict[str, SafetensorsHeader] = {}
    spans: dict[str, TensorSpan] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index_path}: the shard of {name} is not a file name")
        if shard not in headers:
            headers[shard] = read_header(_shard_path(root, index_path, shard))
        span = headers[shard].tensors.get(name)
        if span is None:
            raise CheckpointError(
                f"{index_path} says {name} is in {shard}, but {shard} does not contain it"
            )
        spans[name] = span
    return spans


def _shard_path(root: Path, index_path: Path, shard: str) -> Path:
    path = (root / shard).resolve()
    if not path.is_relative_to(root.resolve()):
        raise CheckpointError(f"{index_path} points outside the checkpoint: {shard!r}")
    if not path.is_file():
        raise CheckpointError(f"shard {shard} named in {index_path} is missing")
    return path


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    extra = len(names) - _MAX_NAMES_SHOWN
    return f"{shown} (+{extra} more)" if extra > 0 else shown
