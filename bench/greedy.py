"""Greedy decoding with one StageModel holding the whole model: the benchmarks' baseline."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from node_agent.runtime import StageModel


def greedy_steps(model: StageModel, prompt: torch.Tensor, tokens: int) -> Iterator[int]:
    """Prefill the prompt ([1, T] token ids), then one token at a time against the KV cache;
    each next() computes one token."""
    cache = model.new_cache(prompt.shape[1] + tokens)
    x, position = prompt, 0
    for _ in range(tokens):
        with torch.inference_mode():
            logits = model(x, cache, position, last_position_only=True)
        position += x.shape[1]
        token = int(torch.argmax(logits[0, -1]))
        yield token
        x = torch.tensor([[token]], device=prompt.device)
