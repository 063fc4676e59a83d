"""One pipeline stage of a Llama-family model: a contiguous slice of decoder layers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from node_agent.runtime.config import ModelConfig
from node_agent.runtime.cuda_graphs import graphed_step, graphs_enabled
from node_agent.runtime.dtypes import pin_full_fp32, resolve_dtype
from node_agent.runtime.errors import WeightLoadError
from node_agent.runtime.kv_cache import KVTensors, StageKVCache
from node_agent.runtime.layers import (
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    attention_mask,
    decode_mask,
)
from node_agent.runtime.tensor_names import validate_stage_range


class _Backbone(nn.Module):
    """Holds what HF keeps under the ``model.`` prefix, restricted to this stage."""

    def __init__(
        self,
        config: ModelConfig,
        start: int,
        end: int,
        has_embedding: bool,
        has_norm: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
            if has_embedding
            else None
        )
        # Keyed by the global layer index so parameter names match the checkpoint.
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(config, dtype=dtype) for i in range(start, end)}
        )
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype) if has_norm else None
        )


class StageModel(nn.Module):
    """Layers [start, end) of a model; the first stage embeds, the last produces logits.

    ``forward`` takes token ids ``[B, T]`` (first stage) or hidden states ``[B, T, hidden]``
    and returns hidden states, or fp32 logits ``[B, T, vocab]`` on the last stage. All rows
    of a batch share positions. Parameters are ordinary nn.Parameters (trainable later);
    they may share storage with the ``tensors`` passed in when dtype and device already match.
    """

    def __init__(
        self,
        config: ModelConfig,
        start: int,
        end: int,
        is_first: bool,
        is_last: bool,
        tensors: Mapping[str, torch.Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        super().__init__()
        validate_stage_range(config, start, end, is_first, is_last)
        self.config = config
        self.start = start
        self.end = end
        self.is_first = is_first
        self.is_last = is_last
        self.device = torch.device(device)
        self.dtype = resolve_dtype(self.device, dtype)
        if self.device.type == "cuda":
            pin_full_fp32()  # fp32 here must be fp32 (training stages, the fp32 logits)
        tied_head = is_last and config.tie_word_embeddings
        # Built on the meta device so no memory is spent on weights about to be replaced.
        with torch.device("meta"):
            self.model = _Backbone(config, start, end, is_first or tied_head, is_last, self.dtype)
            self.lm_head = (
                nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=self.dtype)
                if is_last and not config.tie_word_embeddings
                else None
            )
        self.rotary = RotaryEmbedding(config, self.device)
        self._load_weights(tensors)
        self._windows = [config.sliding_window_for_layer(i) for i in range(start, end)]
        self._graphs = self.device.type == "cuda" and graphs_enabled()

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def new_cache(self, max_len: int, batch: int = 1) -> StageKVCache:
        """An empty KV cache sized for this stage; usable as a KVCacheManager factory."""
        if max_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_len {max_len} exceeds the model's max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        return StageKVCache(
            num_layers=self.num_layers,
            batch=batch,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            max_len=max_len,
            device=self.device,
            dtype=self.dtype,
        )

    def forward(
        self,
        x: torch.Tensor,
        cache: StageKVCache | None = None,
        start_pos: int = 0,
        *,
        last_position_only: bool = False,
        logit_positions: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run the stage on a chunk at absolute positions [start_pos, start_pos + T).

        With a cache the chunk attends to the cached positions [0, start_pos) as well and
        its K/V are stored; ``start_pos`` below ``cache.length`` replays (overwrites) from
        there. Without a cache the chunk only attends to itself. ``last_position_only``
        makes the last stage return logits ``[B, 1, vocab]`` for the chunk's last position:
        sampling needs no more, and a prompt's other positions would cost a vocab-wide
        matmul each (other stages ignore it: the next stage needs every position).
        ``logit_positions`` (offsets in the chunk, last stage only) returns the logits of
        just those positions, ``[B, len, vocab]``: what an audit's probes read.
        """
        self._check_input(x)
        batch, seq = x.shape[:2]
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        if cache is not None:
            self._check_cache(cache, batch)
            cache.check_append(start_pos, seq)
            if seq == 1 and self._graphs and not torch.is_grad_enabled() and not logit_positions:
                try:
                    out = graphed_step(self, cache, x, start_pos, last_position_only)
                except BaseException:
                    cache.truncate(min(cache.length, start_pos))  # as below
                    raise
                if out is not None:
                    cache.commit(start_pos + 1)
                    return out
        hidden = self._embed(x)
        key_start = 0 if cache is not None else start_pos
        num_keys = start_pos + seq - key_start
        positions = torch.arange(start_pos, start_pos + seq, device=self.device)
        cos, sin = self.rotary(positions, self.dtype)
        masks = {
            window: attention_mask(start_pos, seq, key_start, num_keys, window, self.device)
            for window in set(self._windows)
        }
        try:
            for local, (layer, window) in enumerate(
                zip(self.model.layers.values(), self._windows, strict=True)
            ):
                hidden = layer(hidden, cos, sin, masks[window], cache, local, start_pos)
        except BaseException:
            if cache is not None:
                # Some layers may have overwritten positions >= start_pos; drop them all.
                cache.truncate(min(cache.length, start_pos))
            raise
        if cache is not None:
            cache.commit(start_pos + seq)
        if logit_positions is not None and self.is_last:
            hidden = hidden[:, list(logit_positions)]
        return self._output(hidden, last_position_only and logit_positions is None)

    def static_decode(
        self,
        x: torch.Tensor,
        tensors: KVTensors,
        position: torch.Tensor,
        *,
        last_position_only: bool = False,
    ) -> torch.Tensor:
        """One single-position step at ``position`` (a 0-d device tensor) over a cache's
        tensors, with shapes and addresses that do not depend on the position: the step a
        CUDA graph captures (runtime/cuda_graphs.py). It attends to every cache position
        through a mask, so it computes what ``forward`` computes, and validates nothing:
        ``forward`` has checked the input and the position before."""
        hidden = self._embed(x)
        cos, sin = self.rotary(position.view(1), self.dtype)
        keys = torch.arange(tensors.max_len, device=self.device)
        masks = {window: decode_mask(keys, position, window) for window in set(self._windows)}
        for local, (layer, window) in enumerate(
            zip(self.model.layers.values(), self._windows, strict=True)
        ):
            hidden = layer(hidden, cos, sin, masks[window], tensors, local, position)
        return self._output(hidden, last_position_only)

    def _output(self, hidden: torch.Tensor, last_position_only: bool) -> torch.Tensor:
        if not self.is_last:
            return hidden
        if last_position_only:
            hidden = hidden[:, -1:]
        hidden = self.model.norm(hidden)
        head = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return F.linear(hidden, head).float()

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            return self.model.embed_tokens(x.to(self.device))
        return x.to(device=self.device, dtype=self.dtype)

    def _check_input(self, x: torch.Tensor) -> None:
        if self.is_first:
            if x.dtype != torch.int64 or x.dim() != 2:
                raise ValueError(
                    f"first stage expects int64 token ids [batch, seq], got {x.dtype} "
                    f"{list(x.shape)}"
                )
            if x.numel() == 0:
                raise ValueError(f"cannot run an empty chunk {list(x.shape)}")
            # Out-of-range ids would trigger a device-side assert that poisons the CUDA
            # context for every session on this node, so they are rejected here.
            lo, hi = int(x.min()), int(x.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(
                    f"token ids must be in [0, {self.config.vocab_size}), got range [{lo}, {hi}]"
                )
            return
        if not x.is_floating_point() or x.dim() != 3 or x.shape[2] != self.config.hidden_size:
            raise ValueError(
                f"stage expects hidden states [batch, seq, {self.config.hidden_size}], got "
                f"{x.dtype} {list(x.shape)}"
            )
        if x.numel() == 0:
            raise ValueError(f"cannot run an empty chunk {list(x.shape)}")

    def _check_cache(self, cache: StageKVCache, batch: int) -> None:
        if cache.num_layers != self.num_layers:
            raise ValueError(
                f"cache has {cache.num_layers} layers but this stage has {self.num_layers}"
            )
        if cache.batch != batch:
            raise ValueError(f"cache was opened for batch {cache.batch}, input has {batch}")
        if cache.dtype != self.dtype or cache.device != self.device:
            raise ValueError(
                f"cache is {cache.dtype} on {cache.device}, stage runs {self.dtype} on "
                f"{self.device}"
            )

    def _load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        expected = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        problems: list[str] = []
        if missing:
            problems.append(f"missing {missing}")
        if unexpected:
            problems.append(f"unexpected {unexpected}")
        for name in sorted(set(expected) & set(tensors)):
            tensor = tensors[name]
            if tuple(tensor.shape) != expected[name]:
                problems.append(
                    f"{name} has shape {list(tensor.shape)}, expected {list(expected[name])}"
                )
            elif not tensor.is_floating_point():
                problems.append(f"{name} has non-float dtype {tensor.dtype}")
        if problems:
            raise WeightLoadError(
                f"weights do not fit stage [{self.start}, {self.end}) of "
                f"{self.config.architecture}: " + "; ".join(problems)
            )
        converted = {
            name: tensors[name].to(device=self.device, dtype=self.dtype) for name in expected
        }
        self.load_state_dict(converted, strict=True, assign=True)
