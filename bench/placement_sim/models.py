"""Llama 2 model shapes (from the published config.json of each size), in fp16."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = 2  # fp16 weights, activations and KV cache


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params_per_layer(self) -> int:
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv  # q, o, k, v
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down (SwiGLU)
        norms = 2 * self.hidden
        return attention + mlp + norms

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden + self.hidden  # LM head + final norm

    @property
    def kv_values_per_token_per_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim

    @property
    def layer_bytes(self) -> int:
        return self.params_per_layer * DTYPE_BYTES

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return self.kv_values_per_token_per_layer * DTYPE_BYTES

    @property
    def activation_bytes(self) -> int:
        """What one hop sends per token: one hidden state."""
        return self.hidden * DTYPE_BYTES

    def flops_per_token_per_layer(self, context: int) -> float:
        """Matmuls (2 per parameter) plus attention over `context` cached tokens."""
        return 2.0 * self.params_per_layer + 4.0 * context * self.heads * self.head_dim


LLAMA2_7B = ModelShape("llama2-7b", 32, 4096, 11008, 32, 32, 32000)
LLAMA2_13B = ModelShape("llama2-13b", 40, 5120, 13824, 40, 40, 32000)
LLAMA2_70B = ModelShape("llama2-70b", 80, 8192, 28672, 64, 8, 32000)
MODELS = {m.name: m for m in (LLAMA2_7B, LLAMA2_13B, LLAMA2_70B)}
