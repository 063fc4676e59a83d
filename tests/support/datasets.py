"""The training tests' dataset: rows of 17 consecutive token ids from random starts, so
that a model can learn to count and its losses fall within a few steps."""

from __future__ import annotations

import numpy as np

from client.datasets import TokenDataset


def counting_dataset(rows: int = 32) -> TokenDataset:
    rng = np.random.default_rng(0)
    starts = rng.integers(3, 60, size=rows)
    tokens = np.concatenate([np.arange(s, s + 17) for s in starts]).astype(np.int32)
    return TokenDataset("counting", tokens, 17)
