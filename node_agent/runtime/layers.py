"""Llama-family decoder building blocks in plain torch.

Numerics follow transformers' eager Llama/Mistral/Qwen2 code (norm in fp32, RoPE tables in
fp32 then cast) so a stage reproduces the reference model's logits, which verification
between untrusted nodes relies on. Submodule names mirror the Hugging Face parameter names
so a stage's state_dict keys *are* the checkpoint tensor names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from node_agent.runtime.config import ModelConfig
from node_agent.runtime.kv_cache import KVTensors, StageKVCache

_TORCH_MAJOR_MINOR = tuple(int(part) for part in torch.__version__.split(".")[:2])
# enable_gqa arrived in torch 2.5; older torch gets K/V heads repeated explicitly.
_SDPA_HAS_GQA = _TORCH_MAJOR_MINOR >= (2, 5)


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Variance in fp32 even for half inputs, then cast back before the weight (as HF).
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        normed = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * normed.to(input_dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32, CPU), computed operation-for-operation like HF."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling.factor
    low_freq_factor = scaling.low_freq_factor
    high_freq_factor = scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | None = None) -> None:
        super().__init__()
        # Non-persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``[T, head_dim]`` for absolute ``positions`` ``[T]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, T, head_dim]`` by tables ``[T, head_dim]``."""
    return x * cos + rotate_half(x) * sin


def decode_mask(
    key_positions: torch.Tensor, position: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean ``[1, S]`` mask for one query at ``position`` (a 0-d tensor) over keys at
    ``key_positions`` ``[S]``: the same rule as attention_mask, computed on the device so a
    captured graph serves every position."""
    mask = key_positions <= position
    if sliding_window is not None:
        mask = mask & (key_positions > position - sliding_window)
    return mask.view(1, -1)


def attention_mask(
    query_start: int,
    num_queries: int,
    key_start: int,
    num_keys: int,
    sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean ``[T, S]`` mask (True = may attend) over absolute positions, or None if all True.

    Query at absolute position p sees keys at positions <= p, and with a sliding window only
    those > p - window (HF's convention).
    """
    query_end = query_start + num_queries - 1
    key_end = key_start + num_keys - 1
    causal_trivial = key_end <= query_start
    window_trivial = sliding_window is None or key_start > query_end - sliding_window
    if causal_trivial and window_trivial:
        return None
    q_pos = torch.arange(query_start, query_start + num_queries, device=device)[:, None]
    k_pos = torch.arange(key_start, key_start + num_keys, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (k_pos > q_pos - sliding_window)
    return mask


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        q_out = config.num_attention_heads * config.head_dim
        kv_out = config.num_key_value_heads * config.head_dim
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden, q_out, bias=config.qkv_bias, **kw)
        self.k_proj = nn.Linear(hidden, kv_out, bias=config.qkv_bias, **kw)
        self.v_proj = nn.Linear(hidden, kv_out, bias=config.qkv_bias, **kw)
        self.o_proj = nn.Linear(q_out, hidden, bias=config.o_proj_bias, **kw)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: StageKVCache | KVTensors | None,
        cache_layer: int,
        start_pos: int | torch.Tensor,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if cache is not None:
            # A StageKVCache takes an int position, KVTensors a 0-d tensor (captured steps).
            k, v = cache.update(cache_layer, start_pos, k, v)  # type: ignore[arg-type]
        out = _sdpa(q, k, v, mask, self.scale, self.num_heads // self.num_kv_heads)
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(out)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    groups: int,
) -> torch.Tensor:
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    # Query head h uses KV head h // groups, matching HF's repeat_kv.
    return F.scaled_dot_product_attention(
        q,
        k.repeat_interleave(groups, dim=1),
        v.repeat_interleave(groups, dim=1),
        attn_mask=mask,
        scale=scale,
    )


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        kw = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden, inner, bias=config.mlp_bias, **kw)
        self.up_proj = nn.Linear(hidden, inner, bias=config.mlp_bias, **kw)
        self.down_proj = nn.Linear(inner, hidden, bias=config.mlp_bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = Attention(config, device, dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, device, dtype
        )
        self.mlp = MLP(config, device, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: StageKVCache | KVTensors | None,
        cache_layer: int,
        start_pos: int | torch.Tensor,
    ) -> torch.Tensor:
        # Out-of-place residual adds keep the graph valid when training backprops through us.
        h = x + self.self_attn(
            self.input_layernorm(x), cos, sin, mask, cache, cache_layer, start_pos
        )
        return h + self.mlp(self.post_attention_layernorm(h))
