"""The model families of the contract: which architectures a checkpoint may declare, and
which bias tensors each one has. The coordinator (checking imports) and the node runtime
(loading shards) must agree on this exactly, so both read it from here.

Biases follow transformers: Qwen2 always has q/k/v biases, Mistral never has any, Llama has
q/k/v/o biases with `attention_bias` and MLP biases with `mlp_bias`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)
ARCHITECTURE_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


# What transformers assumes when config.json gives no max_position_embeddings.
DEFAULT_MAX_POSITIONS: dict[str, int] = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 4096 * 32,
    "Qwen2ForCausalLM": 32768,
}


def declared_max_positions(raw: Mapping[str, Any], architecture: str) -> int:
    """The positions (prompt and generated tokens) a model holds: max_position_embeddings,
    or its architecture's default. The node runtime refuses a config whose value is not a
    positive integer; a reader that only sizes sessions takes the default then."""
    value = raw.get("max_position_embeddings")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return DEFAULT_MAX_POSITIONS.get(architecture, 0)


class UnsupportedArchitecture(ValueError):
    """config.json names no architecture Tessera runs; the message lists the ones it does."""


def resolve_architecture(raw: Mapping[str, Any]) -> str:
    """The supported architecture a config.json declares (`architectures`, else `model_type`)."""
    names = raw.get("architectures")
    if isinstance(names, str):
        names = [names]
    if names:
        if not isinstance(names, list):
            raise UnsupportedArchitecture(
                f"config.json: architectures must be a list, got {names!r}"
            )
        for name in names:
            if name in SUPPORTED_ARCHITECTURES:
                return name
        raise UnsupportedArchitecture(
            f"config.json: architecture {names} is not supported; Tessera runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = raw.get("model_type")
    if model_type in ARCHITECTURE_BY_MODEL_TYPE:
        return ARCHITECTURE_BY_MODEL_TYPE[model_type]
    raise UnsupportedArchitecture(
        f"config.json names no supported architecture (architectures missing, model_type="
        f"{model_type!r}); Tessera runs {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def bias_layout(architecture: str, attention_bias: bool, mlp_bias: bool) -> tuple[bool, bool, bool]:
    """(qkv_bias, o_proj_bias, mlp_bias) exactly as transformers builds each architecture."""
    if architecture == "Qwen2ForCausalLM":
        return True, False, False
    if architecture == "MistralForCausalLM":
        # transformers' Mistral ignores attention_bias / mlp_bias; honouring them would make
        # us expect tensors a Mistral checkpoint never has.
        return False, False, False
    return attention_bias, attention_bias, mlp_bias
