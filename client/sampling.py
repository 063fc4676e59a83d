"""Pick the next token from logits: greedy, temperature, nucleus (top-p). numpy only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be 0 or more, got {self.seed}")


class Sampler:
    """Stateful so that one seed gives one reproducible sequence of draws."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        return sample(logits, self.params, self._rng)

    @property
    def state(self) -> dict[str, Any]:
        """Where the draws stand: set it back to draw the same token again (a rollback)."""
        return self._rng.bit_generator.state

    @state.setter
    def state(self, value: dict[str, Any]) -> None:
        self._rng.bit_generator.state = value


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Next token id from a 1-D vector of logits."""
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"expected a non-empty 1-D logits vector, got shape {logits.shape}")
    scores = logits.astype(np.float64)
    if not np.isfinite(scores).any():
        raise ValueError("every logit is NaN or infinite; the pipeline returned garbage")
    scores = np.where(np.isfinite(scores), scores, -np.inf)
    if params.temperature == 0.0:
        return int(np.argmax(scores))
    probs = _softmax(scores / params.temperature)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return int(rng.choice(probs.size, p=probs))


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max())
    return shifted / shifted.sum()


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    # The token that crosses top_p is kept, so at least one token always survives.
    keep = int(np.searchsorted(cumulative, top_p, side="left")) + 1
    kept = np.zeros_like(probs)
    kept[order[:keep]] = probs[order[:keep]]
    return kept / kept.sum()
