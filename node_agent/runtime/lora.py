"""LoRA adapters attached to a StageModel's projections without touching its modules.

Each adapted ``nn.Linear`` gets a forward hook that adds ``scale * B(A(x))`` to its output,
with ``A: [rank, in]`` (uniform, like PEFT's kaiming init) and ``B: [out, rank]`` zero, so a
fresh adapter leaves the model's output unchanged. The base layers keep their Hugging Face
parameter names, so the stage still loads and serves checkpoints as before; the adapters live
here, named ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``.

Each adapter's initial values come from a generator seeded by (seed, module name), so a layer
starts identical whichever stage it lands on: a model split over 3 nodes trains exactly like
the same model in one process.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from node_agent.runtime.stage_model import StageModel

# The attention and MLP projections of every Llama-family decoder layer.
LORA_TARGETS: tuple[str, ...] = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


class LoRAAdapter(nn.Module):
    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator
    ) -> None:
        super().__init__()
        weight = base.weight
        bound = 1.0 / math.sqrt(base.in_features)
        a_init = (torch.rand(rank, base.in_features, generator=generator) * 2 - 1) * bound
        self.lora_A = nn.Parameter(a_init.to(device=weight.device, dtype=weight.dtype))
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, device=weight.device, dtype=weight.dtype)
        )
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale

    def hook(
        self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> torch.Tensor:
        return output + self(args[0])

    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A``: what merging this adapter adds to the base weight."""
        return (self.lora_B @ self.lora_A) * self.scale


class LoRAAdapters(nn.Module):
    """All adapters of one stage; ``remove()`` detaches them from the stage again."""

    def __init__(self, stage: StageModel, rank: int, alpha: float, seed: int) -> None:
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"lora_rank must be a positive integer, got {rank!r}")
        if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"lora_alpha must be a positive number, got {alpha!r}")
        self.rank = rank
        self.alpha = float(alpha)
        # ModuleDict keys may not contain dots, so modules are registered under an index
        # and looked up by their stage path through _by_name.
        self.adapters = nn.ModuleList()
        self._by_name: dict[str, LoRAAdapter] = {}
        self._handles: list[RemovableHandle] = []
        for module_name, module in _target_linears(stage):
            generator = torch.Generator().manual_seed(_adapter_seed(seed, module_name))
            adapter = LoRAAdapter(module, rank, alpha, generator)
            self.adapters.append(adapter)
            self._by_name[module_name] = adapter
            self._handles.append(module.register_forward_hook(adapter.hook))

    def named_adapter_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for module_name, adapter in self._by_name.items():
            yield f"{module_name}.lora_A.weight", adapter.lora_A
            yield f"{module_name}.lora_B.weight", adapter.lora_B

    def merged_weights(self, stage: StageModel) -> dict[str, torch.Tensor]:
        """The stage's state_dict (HF names) with every adapter folded into its base weight."""
        merged = {name: t.detach().clone() for name, t in stage.state_dict().items()}
        with torch.no_grad():
            for module_name, adapter in self._by_name.items():
                name = f"{module_name}.weight"
                merged[name] = merged[name] + adapter.delta_weight().to(merged[name].dtype)
        return merged

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def lora_parameter_count(in_out_pairs: list[tuple[int, int]], rank: int) -> int:
    return sum(rank * (fan_in + fan_out) for fan_in, fan_out in in_out_pairs)


def _target_linears(stage: StageModel) -> Iterator[tuple[str, nn.Linear]]:
    for layer_index, layer in stage.model.layers.items():
        for target in LORA_TARGETS:
            module = layer.get_submodule(target)
            if not isinstance(module, nn.Linear):
                raise TypeError(f"expected nn.Linear at layer {layer_index} {target}")
            yield f"model.layers.{layer_index}.{target}", module


def _adapter_seed(seed: int, module_name: str) -> int:
    # crc32 rather than hash(): Python salts str hashes per process, nodes must agree.
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % (2**63)
