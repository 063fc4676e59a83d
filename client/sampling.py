"""The client's sampler: ``protos.sampling`` with a seed fixed for the whole generation.

An unseeded generation still gets a seed (a random one): a node that runs the ring
(``ForwardRequest.ring``) must draw the same tokens as the client.
"""

from __future__ import annotations

import secrets
from dataclasses import replace

import numpy as np

from protos.sampling import MAX_SEED, SamplingParams, draw_at, sample

__all__ = ["Sampler", "SamplingParams", "sample"]


class Sampler:
    """Draws the token at a position; the same position always gives the same draw."""

    def __init__(self, params: SamplingParams) -> None:
        if params.seed is None:
            params = replace(params, seed=secrets.randbelow(MAX_SEED + 1))
        self.params = params

    def __call__(self, logits: np.ndarray, position: int) -> int:
        return draw_at(logits, self.params, position)
