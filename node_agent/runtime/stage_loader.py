"""Build a StageModel straight from a checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from node_agent.runtime.checkpoint import load_model_config, load_stage_tensors
from node_agent.runtime.dtypes import resolve_dtype
from node_agent.runtime.stage_model import StageModel
from node_agent.runtime.tensor_names import tensor_names_for_stage


def load_stage_model(
    model_dir: str | Path,
    start: int,
    end: int,
    *,
    is_first: bool | None = None,
    is_last: bool | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> StageModel:
    """Load layers [start, end); first/last default to whether the range touches the ends."""
    config = load_model_config(model_dir)
    first = start == 0 if is_first is None else is_first
    last = end == config.num_hidden_layers if is_last is None else is_last
    compute_dtype = resolve_dtype(device, dtype)
    names = tensor_names_for_stage(config, start, end, first, last)
    tensors = load_stage_tensors(model_dir, names)
    return StageModel(config, start, end, first, last, tensors, device=device, dtype=compute_dtype)
