"""Pick the next token from logits: greedy, temperature, nucleus (top-p). numpy only.

Shared by the client, which samples every token it yields, and by the node that ends the
model when it runs a ring (``ForwardRequest.ring``): that node samples the next token
itself and starts the next step at once. Both must draw the very same token from the same
float32 logits, so a seeded draw depends only on the seed and the token's position
(``draw_at``), never on how many draws came before: a rollback or a ring that starts
mid-generation draws what a fresh run draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The seeds a ring carries (uint64 on the wire, numpy accepts any non-negative int).
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not np.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")


def draw_at(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """The token at ``position`` (where it goes in the sequence) from its logits: the same
    token wherever and however often it is drawn."""
    if params.temperature == 0.0:
        return sample(logits, params, None)
    rng = np.random.default_rng([params.seed or 0, position])
    return sample(logits, params, rng)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """Next token id from a 1-D vector of logits (``rng`` unused when greedy)."""
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"expected a non-empty 1-D logits vector, got shape {logits.shape}")
    scores = logits.astype(np.float64)
    if not np.isfinite(scores).any():
        raise ValueError("every logit is NaN or infinite; the pipeline returned garbage")
    scores = np.where(np.isfinite(scores), scores, -np.inf)
    if params.temperature == 0.0:
        return int(np.argmax(scores))
    assert rng is not None, "a draw at a temperature needs a generator"
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
