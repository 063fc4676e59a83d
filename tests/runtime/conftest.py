"""Tiny random Hugging Face checkpoints built on the fly (no model hub access needed)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

# Small matrices gain nothing from many threads, and CI boxes have few cores.
torch.set_num_threads(2)

BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}

# variant -> (transformers model family, config overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True, "vocab_size": 128}),
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3_rope": (
        "llama",
        {
            # original context 32 puts the RoPE bands into all three llama3 regimes.
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 10000.0,
        },
    ),
    "mistral": ("mistral", {"sliding_window": 6}),
    "qwen2": ("qwen2", {}),
    "qwen2_sliding": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2},
    ),
}

# Stage split used by the pipeline tests: [0,1), [1,3), [3,4).
STAGE_BOUNDS: list[tuple[int, int]] = [(0, 1), (1, 3), (3, 4)]


@dataclass
class TinyCheckpoint:
    path: Path
    reference: Any  # the transformers *ForCausalLM, eval mode, fp32


def _model_classes(family: str) -> tuple[Any, Any]:
    import transformers

    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    }[family]
    return getattr(transformers, names[0]), getattr(transformers, names[1])


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's tiny init (std 0.02) so logits are O(1) and comparisons mean something."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.5 * noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[1]))


def build_tiny_checkpoint(
    variant: str, directory: Path, max_shard_size: str | None = None, seed: int = 0
) -> TinyCheckpoint:
    family, overrides = VARIANTS[variant]
    config_cls, model_cls = _model_classes(family)
    config = config_cls(**{**BASE_CONFIG, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomize(model, seed)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **save_kwargs)
    return TinyCheckpoint(path=directory, reference=model)


@pytest.fixture(scope="session")
def tiny_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., TinyCheckpoint]:
    """Factory ``tiny_checkpoint(variant, sharded=False)``, memoized for the session."""
    built: dict[tuple[str, bool], TinyCheckpoint] = {}

    def get(variant: str, sharded: bool = False) -> TinyCheckpoint:
        key = (variant, sharded)
        if key not in built:
            directory = tmp_path_factory.mktemp(f"{variant}{'_sharded' if sharded else ''}")
            built[key] = build_tiny_checkpoint(
                variant, directory, max_shard_size="100KB" if sharded else None
            )
        return built[key]

    return get


@pytest.fixture(scope="session")
def stage_bounds() -> list[tuple[int, int]]:
    return list(STAGE_BOUNDS)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Tests asking for `any_variant` run once per tiny architecture variant.
    if "any_variant" in metafunc.fixturenames:
        metafunc.parametrize("any_variant", sorted(VARIANTS))
