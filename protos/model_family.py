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
