"""client/kept_logits.py: the last hop's rows kept for audits stay within their budget."""

from __future__ import annotations

import numpy as np

from client.kept_logits import KeptLogits
from protos import codec


def row(value: float, vocab: int = 100) -> np.ndarray:
    return np.full((1, 1, vocab), value, dtype=np.float32)


def test_rows_come_back_as_kept_and_the_oldest_go_first_past_the_budget() -> None:
    kept = KeptLogits(budget_bytes=3 * 400)
    for step in range(5):
        kept.keep(("span", step), codec.encode(row(step), "float32"))
    assert len(kept) == 3 and kept.bytes == 1200 and kept.dropped == 2
    assert kept.row(("span", 0)) is None and kept.tensor(("span", 1)) is None
    got = kept.row(("span", 4))
    assert got is not None and got.shape == (100,) and float(got[0]) == 4.0
    kept.pop(("span", 3))
    kept.pop(("span", 3))  # twice is harmless
    assert len(kept) == 2 and kept.bytes == 800


def test_keeping_a_step_again_replaces_its_row() -> None:
    kept = KeptLogits(budget_bytes=10_000)
    kept.keep("k", codec.encode(row(1.0), "float32"))
    kept.keep("k", codec.encode(row(2.0), "float32"))
    got = kept.row("k")
    assert len(kept) == 1 and kept.bytes == 400 and got is not None and float(got[0]) == 2.0


def test_a_row_larger_than_the_budget_is_not_kept() -> None:
    kept = KeptLogits(budget_bytes=100)
    kept.keep("big", codec.encode(row(1.0), "float32"))
    assert len(kept) == 0 and kept.bytes == 0 and kept.dropped == 1
