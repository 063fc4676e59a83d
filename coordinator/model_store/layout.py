"""What a supported checkpoint must contain: architectures, tensor names, shapes and dtypes.

This is the coordinator's single source of that knowledge (the node runtime keeps its own
copy in node_agent/runtime/tensor_names.py, because components never import each other).
Biases follow transformers exactly: Qwen2 always has q/k/v biases, Mistral never has any,
Llama has q/k/v/o biases with `attention_bias` and MLP biases with `mlp_bias`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.model_store.errors import CheckpointError
from protos.model_family import (
    UnsupportedArchitecture,
    bias_layout,
    resolve_architecture,
)

# Weights a node can compute with; bytes per element.
DTYPE_ITEMSIZE: dict[str, int] = {"F32": 4, "F16": 2, "BF16": 2}

EMBEDDING = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
NOT_A_LAYER = -1

# Far above any real model, low enough that a hostile config cannot make us build a
# billion-entry tensor table before the size limit is even checked.
MAX_LAYERS = 4096
MAX_DIMENSION = 1 << 24

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def layer_of(tensor_name: str) -> int:
    """The decoder layer a tensor belongs to, or NOT_A_LAYER (-1) for embedding/norm/head."""
    match = _LAYER_NAME.match(tensor_name)
    return int(match.group(1)) if match else NOT_A_LAYER


@dataclass(frozen=True)
class ModelLayout:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool

    @classmethod
    def from_config(cls, raw: Any) -> ModelLayout:
        """Read the fields that decide the tensor table; CheckpointError names what is wrong."""
        if not isinstance(raw, Mapping):
            raise CheckpointError(f"config.json must hold a JSON object, got {type(raw).__name__}")
        architecture = _architecture(raw)
        hidden = _positive_int(raw, "hidden_size")
        heads = _positive_int(raw, "num_attention_heads")
        kv_heads = _positive_int(raw, "num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        if raw.get("head_dim") is None and hidden % heads:
            raise CheckpointError(
                f"config.json: hidden_size ({hidden}) is not divisible by num_attention_heads "
                f"({heads}) and no head_dim is given"
            )
        num_layers = _positive_int(raw, "num_hidden_layers")
        if num_layers > MAX_LAYERS:
            raise CheckpointError(
                f"config.json: num_hidden_layers={num_layers} is beyond the limit of {MAX_LAYERS}"
            )
        qkv_bias, o_proj_bias, mlp_bias = _biases(raw, architecture)
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_positive_int(raw, "head_dim", default=hidden // heads),
            vocab_size=_positive_int(raw, "vocab_size"),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", default=False),
            qkv_bias=qkv_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the architecture needs, in checkpoint order, with its shape."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {EMBEDDING: (self.vocab_size, hidden)}
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}"
            shapes[f"{p}.input_layernorm.weight"] = (hidden,)
            for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                shapes[f"{p}.self_attn.{proj}.weight"] = (out, hidden)
                if self.qkv_bias:
                    shapes[f"{p}.self_attn.{proj}.bias"] = (out,)
            shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, q_out)
            if self.o_proj_bias:
                shapes[f"{p}.self_attn.o_proj.bias"] = (hidden,)
            shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
            for proj, shape, bias in (
                ("gate_proj", (inter, hidden), (inter,)),
                ("up_proj", (inter, hidden), (inter,)),
                ("down_proj", (hidden, inter), (hidden,)),
            ):
                shapes[f"{p}.mlp.{proj}.weight"] = shape
                if self.mlp_bias:
                    shapes[f"{p}.mlp.{proj}.bias"] = bias
        shapes[FINAL_NORM] = (hidden,)
        if not self.tie_word_embeddings:
            shapes[LM_HEAD] = (self.vocab_size, hidden)
        return shapes


def tensor_nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * DTYPE_ITEMSIZE[dtype]


def check_tensor(name: str, dtype: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    """Raise CheckpointError when a tensor's dtype or shape does not fit the config."""
    if dtype not in DTYPE_ITEMSIZE:
        raise CheckpointError(
            f"tensor {name} has dtype {dtype}; Tessera accepts {', '.join(DTYPE_ITEMSIZE)} "
            "(convert the checkpoint, e.g. with torch_dtype=torch.bfloat16)"
        )
    if tuple(shape) != want:
        raise CheckpointError(
            f"tensor {name} has shape {list(shape)} but config.json implies {list(want)}; "
            "the weights do not belong to this config"
        )


def _architecture(raw: Mapping[str, Any]) -> str:
    try:
        return resolve_architecture(raw)
    except UnsupportedArchitecture as exc:
        raise CheckpointError(str(exc)) from None


def _biases(raw: Mapping[str, Any], architecture: str) -> tuple[bool, bool, bool]:
    return bias_layout(
        architecture,
        _bool(raw, "attention_bias", default=False),
        _bool(raw, "mlp_bias", default=False),
    )


def _positive_int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"config.json is missing the required field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_DIMENSION:
        raise CheckpointError(
            f"config.json: {key!r} must be an integer in 1..{MAX_DIMENSION}, got {value!r}"
        )
    return value


def _bool(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json: {key!r} must be true or false, got {value!r}")
    return value
