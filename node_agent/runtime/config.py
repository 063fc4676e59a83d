"""Model description parsed from a Hugging Face ``config.json``.

Only the Llama family (Llama, Mistral, Qwen2) is supported: they share one decoder layout, so a
single plain-torch implementation serves all of them. Anything we cannot reproduce exactly is
refused up front, because a silently different model would poison every pipeline it joins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from node_agent.runtime.errors import UnsupportedModelError
from protos.model_family import (
    DEFAULT_MAX_POSITIONS,
    UnsupportedArchitecture,
    bias_layout,
    resolve_architecture,
)

# transformers' per-class defaults, used when config.json omits the key.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_QWEN2_MAX_WINDOW_LAYERS = 28

_FULL_ATTENTION = "full_attention"
_SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 style frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    rope_scaling: Llama3RopeScaling | None = None
    hidden_act: str = "silu"
    # One entry per layer: None for full attention, else the window size in tokens.
    layer_sliding_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed config.json; raises UnsupportedModelError with a fix hint."""
        if not isinstance(raw, Mapping):
            raise UnsupportedModelError(
                f"config.json must contain a JSON object, got {type(raw).__name__}"
            )
        architecture = _architecture(raw)
        hidden_size = _positive_int(raw, "hidden_size")
        intermediate_size = _positive_int(raw, "intermediate_size")
        num_layers = _positive_int(raw, "num_hidden_layers")
        num_heads = _positive_int(raw, "num_attention_heads")
        vocab_size = _positive_int(raw, "vocab_size")
        num_kv_heads = _positive_int(raw, "num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads}) for grouped-query attention; check config.json"
            )
        if raw.get("head_dim") is None and hidden_size % num_heads != 0:
            raise UnsupportedModelError(
                f"hidden_size ({hidden_size}) is not divisible by num_attention_heads "
                f"({num_heads}) and config.json gives no explicit head_dim"
            )
        head_dim = _positive_int(raw, "head_dim", default=hidden_size // num_heads)

        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(
                f"hidden_act {hidden_act!r} is not supported; only 'silu' (SwiGLU MLP) is"
            )
        partial_rotary = _rope_source(raw).get(
            "partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)
        )
        if partial_rotary not in (None, 1, 1.0):
            raise UnsupportedModelError(
                f"partial_rotary_factor={partial_rotary} is not supported; only full-width RoPE is"
            )

        qkv_bias, o_proj_bias, mlp_bias = _biases(raw, architecture)
        max_positions = _positive_int(
            raw, "max_position_embeddings", default=DEFAULT_MAX_POSITIONS[architecture]
        )
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(raw, "rms_norm_eps", _DEFAULT_RMS_NORM_EPS),
            rope_theta=_rope_theta(raw),
            vocab_size=vocab_size,
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", default=False),
            qkv_bias=qkv_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            max_position_embeddings=max_positions,
            rope_scaling=_rope_scaling(raw, max_positions),
            hidden_act=hidden_act,
            layer_sliding_windows=_layer_sliding_windows(raw, architecture, num_layers),
        )

    def sliding_window_for_layer(self, layer: int) -> int | None:
        if not self.layer_sliding_windows:
            return None
        return self.layer_sliding_windows[layer]

    def params_per_layer(self) -> int:
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        attention = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        if self.qkv_bias:
            attention += q_out + 2 * kv_out
        if self.o_proj_bias:
            attention += self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + self.hidden_size
        norms = 2 * self.hidden_size
        return attention + mlp + norms

    def bytes_per_layer(self, dtype_bytes: int) -> int:
        """Weight bytes of one decoder layer stored with ``dtype_bytes`` per element."""
        return self.params_per_layer() * dtype_bytes

    def embedding_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the embedding matrix (also the LM head's size, tied or not)."""
        return self.vocab_size * self.hidden_size * dtype_bytes

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int) -> int:
        """KV cache bytes one token occupies in one layer (K and V, all KV heads)."""
        return 2 * self.num_key_value_heads * self.head_dim * dtype_bytes


def _architecture(raw: Mapping[str, Any]) -> str:
    try:
        return resolve_architecture(raw)
    except UnsupportedArchitecture as exc:
        raise UnsupportedModelError(str(exc)) from None


def _biases(raw: Mapping[str, Any], architecture: str) -> tuple[bool, bool, bool]:
    return bias_layout(
        architecture,
        _bool(raw, "attention_bias", default=False),
        _bool(raw, "mlp_bias", default=False),
    )


def _rope_source(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The dict holding RoPE settings: v4 ``rope_scaling`` or v5 ``rope_parameters``."""
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise UnsupportedModelError(f"{key} must be an object, got {value!r}")
        if any(isinstance(v, Mapping) for v in value.values()):
            raise UnsupportedModelError(f"per-layer-type {key} ({sorted(value)}) is not supported")
        if value:
            return value
    return {}


def _rope_theta(raw: Mapping[str, Any]) -> float:
    source = raw.get("rope_parameters")
    theta = source.get("rope_theta") if isinstance(source, Mapping) else None
    if theta is None:
        theta = raw.get("rope_theta", _DEFAULT_ROPE_THETA)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise UnsupportedModelError(f"rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def _rope_scaling(raw: Mapping[str, Any], max_positions: int) -> Llama3RopeScaling | None:
    source = _rope_source(raw)
    rope_type = source.get("rope_type", source.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"RoPE scaling type {rope_type!r} is not supported; only none and 'llama3' are"
        )
    # transformers falls back to the same values when the scaling dict omits them.
    original = source.get(
        "original_max_position_embeddings",
        raw.get("original_max_position_embeddings", max_positions),
    )
    try:
        scaling = Llama3RopeScaling(
            factor=float(source["factor"]),
            low_freq_factor=float(source["low_freq_factor"]),
            high_freq_factor=float(source["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    except KeyError as err:
        raise UnsupportedModelError(
            f"llama3 RoPE scaling is missing {err.args[0]!r}; expected factor, "
            "low_freq_factor, high_freq_factor, original_max_position_embeddings"
        ) from err
    except (TypeError, ValueError) as err:
        raise UnsupportedModelError(f"llama3 RoPE scaling has a non-numeric value: {err}") from err
    values = (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor)
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise UnsupportedModelError(f"llama3 RoPE scaling values must be positive: {source}")
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise UnsupportedModelError(
            "llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got "
            f"{scaling.high_freq_factor} <= {scaling.low_freq_factor}"
        )
    if scaling.original_max_position_embeddings <= 0:
        raise UnsupportedModelError(
            "llama3 RoPE scaling needs a positive original_max_position_embeddings"
        )
    return scaling


def _layer_sliding_windows(
    raw: Mapping[str, Any], architecture: str, num_layers: int
) -> tuple[int | None, ...]:
    if architecture == "LlamaForCausalLM":
        return (None,) * num_layers
    window = raw.get("sliding_window")
    if window is not None:
        window = _positive_int(raw, "sliding_window")
    if architecture == "MistralForCausalLM":
        # Mistral applies its window (if any) to every layer and ignores layer_types.
        return (window,) * num_layers
    # Qwen2: the window only exists when use_sliding_window is set, and then only on the
    # layers that layer_types (or max_window_layers) marks as sliding.
    if not _bool(raw, "use_sliding_window", default=False):
        window = None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        max_window_layers = _positive_int(
            raw, "max_window_layers", default=_DEFAULT_QWEN2_MAX_WINDOW_LAYERS
        )
        layer_types = [
            _SLIDING_ATTENTION if window is not None and i >= max_window_layers else _FULL_ATTENTION
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
        )
    unknown = sorted({t for t in layer_types} - {_FULL_ATTENTION, _SLIDING_ATTENTION})
    if unknown:
        raise UnsupportedModelError(f"unsupported attention layer types {unknown}")
    return tuple(window if t == _SLIDING_ATTENTION else None for t in layer_types)


def _positive_int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key)
    if value is None:
        if default is None:
            raise UnsupportedModelError(f"config.json is missing required field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(
            f"config field {key!r} must be a positive integer, got {value!r}"
        )
    return value


def _positive_float(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UnsupportedModelError(
            f"config field {key!r} must be a positive number, got {value!r}"
        )
    return float(value)


def _bool(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UnsupportedModelError(f"config field {key!r} must be true or false, got {value!r}")
    return value
