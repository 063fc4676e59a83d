"""Read a stage's tensors from a Hugging Face style safetensors checkpoint directory.

Layout: ``config.json`` plus either ``model.safetensors`` or ``model.safetensors.index.json``
and the shards it names. safetensors is read lazily (``safe_open``), so a stage touches only
its own tensors, not the whole model. Pickle checkpoints (``*.bin``, ``*.pt``) are refused:
volunteer nodes load files they did not produce, and unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from node_agent.runtime.config import ModelConfig
from node_agent.runtime.errors import (
    CheckpointError,
    MissingTensorError,
    PickleCheckpointError,
)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

_MAX_NAMES_IN_MESSAGE = 10


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found; a checkpoint directory needs a config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    return ModelConfig.from_dict(raw)


def tensor_locations(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file holding it."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    index_path = root / INDEX_FILE
    if index_path.is_file():
        return _locations_from_index(root, index_path)
    single = root / SINGLE_FILE
    if single.is_file():
        with _open(single) as handle:
            return {name: single for name in handle.keys()}
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise PickleCheckpointError(
            f"{root} only has pickle weights ({', '.join(pickles[:3])}); they are refused "
            "because loading pickle can execute code. Convert the checkpoint to safetensors "
            "(e.g. save_pretrained(dir, safe_serialization=True))."
        )
    raise CheckpointError(f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def load_stage_tensors(
    model_dir: str | Path, names: Iterable[str], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Read exactly ``names`` from the checkpoint; fails before reading if any is absent."""
    wanted = list(dict.fromkeys(names))
    locations = tensor_locations(model_dir)
    missing = [name for name in wanted if name not in locations]
    if missing:
        raise MissingTensorError(
            f"checkpoint {model_dir} lacks {len(missing)} tensor(s) this stage needs: "
            f"{_summarize(missing)}"
        )
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in wanted:
        by_file[locations[name]].append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, file_names in by_file.items():
        with _open(path, device) as handle:
            present = set(handle.keys())
            absent = [name for name in file_names if name not in present]
            if absent:
                raise MissingTensorError(
                    f"{path.name} does not contain {_summarize(absent)} although "
                    f"{INDEX_FILE} says it does; the checkpoint is inconsistent"
                )
            for name in file_names:
                tensors[name] = handle.get_tensor(name)
    # Same order as requested, whatever order the shards were read in.
    return {name: tensors[name] for name in wanted}


def _locations_from_index(root: Path, index_path: Path) -> dict[str, Path]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {index_path}: {err}") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path} has no 'weight_map' object")
    resolved_root = root.resolve()
    shards: dict[str, Path] = {}
    locations: dict[str, Path] = {}
    for name, shard in weight_map.items():
        if shard not in shards:
            shards[shard] = _shard_path(root, resolved_root, shard, index_path)
        locations[name] = shards[shard]
    return locations


def _shard_path(root: Path, resolved_root: Path, shard: object, index_path: Path) -> Path:
    if not isinstance(shard, str) or not shard.endswith(".safetensors"):
        raise CheckpointError(f"{index_path} names a non-safetensors shard {shard!r}")
    path = root / shard
    # A downloaded index must not make us read files outside the checkpoint directory.
    if not path.resolve().is_relative_to(resolved_root):
        raise CheckpointError(f"{index_path} points outside the checkpoint: {shard!r}")
    if not path.is_file():
        raise CheckpointError(f"shard {shard} listed in {index_path} is missing")
    return path


def _open(path: Path, device: str | torch.device = "cpu") -> safe_open:
    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except Exception as err:  # safetensors raises its own untyped errors for corrupt headers
        raise CheckpointError(f"cannot open {path} as safetensors: {err}") from err


def _summarize(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_IN_MESSAGE])
    extra = len(names) - _MAX_NAMES_IN_MESSAGE
    return f"{shown} (+{extra} more)" if extra > 0 else shown
