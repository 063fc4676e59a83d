"""protos/logit_probes.py: what a probe answer must show for a cheat on the last hop to be seen.

The answers here are built the way a node builds them (from a row of logits), so each test
is the comparison a client makes between a primary's signed row and a checker's probe.
"""

from __future__ import annotations

import numpy as np
import pytest

from protos import logit_probes, output_check
from protos.tessera.v1 import stage_pb2

VOCAB = 5000
TOLERANCE = output_check.tolerance("cpu", "float32", layers=1)


def answer_from(row: np.ndarray, probe: stage_pb2.LogitProbe) -> stage_pb2.ProbeAnswer:
    """A checker's honest answer, from its own row (as node_agent/stage_server.py does)."""
    top = logit_probes.highest(row)
    return stage_pb2.ProbeAnswer(
        position=probe.position,
        top_ids=top,
        top_logits=row[top].tolist(),
        probed_logits=row[list(probe.token_ids)].tolist(),
        logsumexp=logit_probes.logsumexp(row),
    )


@pytest.fixture
def honest() -> np.ndarray:
    rng = np.random.default_rng(5)
    row = rng.normal(0.0, 2.0, VOCAB).astype(np.float32)
    row[17] += 9.0  # a clear favourite, as in a trained model's next-token row
    return row


def compare(primary: np.ndarray, checker: np.ndarray) -> float:
    """The client's view: it names the primary's highest ids; the checker answers."""
    probe = logit_probes.probe_for(primary, position=3)
    return logit_probes.probe_error(primary, probe, answer_from(checker, probe))


def test_highest_is_the_top_ids_highest_first() -> None:
    row = np.array([0.5, 3.0, -1.0, 3.0, 2.0], dtype=np.float32)
    assert logit_probes.highest(row, 3) == [1, 3, 4]  # a tie goes to the lower id
    assert logit_probes.highest(row, 10) == [1, 3, 4, 0, 2]
    assert logit_probes.highest(row, 0) == []


def test_logsumexp_is_stable_for_large_logits() -> None:
    row = np.array([1000.0, 1000.0], dtype=np.float32)
    assert logit_probes.logsumexp(row) == pytest.approx(1000.0 + np.log(2.0))


def test_an_honest_pair_agrees_within_rounding(honest: np.ndarray) -> None:
    rounded = honest + np.random.default_rng(1).normal(0.0, 1e-5, VOCAB).astype(np.float32)
    assert compare(honest, honest) == 0.0
    assert compare(honest, rounded) < TOLERANCE / 10


def test_raising_a_token_the_model_would_not_pick_is_seen(honest: np.ndarray) -> None:
    cheat = honest.copy()
    cheat[4242] = honest.max() + 0.5  # the primary now samples 4242
    assert compare(cheat, honest) > TOLERANCE * 10


def test_lowering_the_token_the_model_would_pick_is_seen(honest: np.ndarray) -> None:
    cheat = honest.copy()
    cheat[17] -= 12.0  # the favourite is gone from the primary's top ids
    assert 17 not in logit_probes.highest(cheat)
    assert compare(cheat, honest) > TOLERANCE * 10


def test_moving_mass_into_the_tail_is_seen(honest: np.ndarray) -> None:
    cheat = honest.copy()
    tail = np.argsort(honest)[: VOCAB // 2]
    cheat[tail] += 4.0  # every top value untouched
    assert logit_probes.highest(cheat) == logit_probes.highest(honest)
    assert compare(cheat, honest) > TOLERANCE * 10


BAD_ANSWERS = {
    "another position": dict(position=4),
    "unpaired top values": dict(top_logits=[1.0]),
    "too few top ids": dict(top_ids=[1, 2], top_logits=[1.0, 2.0]),
    "a top id outside the vocabulary": dict(top_ids=[VOCAB + 1, *range(1, logit_probes.TOP_K)]),
    "repeated top ids": dict(top_ids=[2] * logit_probes.TOP_K),
    "probed values missing": dict(probed_logits=[]),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS), ids=list(BAD_ANSWERS))
def test_an_answer_that_does_not_fit_the_probe_is_infinitely_wrong(
    honest: np.ndarray, case: str
) -> None:
    probe = logit_probes.probe_for(honest, position=3)
    answer = answer_from(honest, probe)
    for name, value in BAD_ANSWERS[case].items():
        if isinstance(value, list):
            answer.ClearField(name)
            getattr(answer, name).extend(value)
        else:
            setattr(answer, name, value)
    assert logit_probes.answer_problem(answer, probe, VOCAB) is not None
    assert logit_probes.probe_error(honest, probe, answer) == float("inf")


def test_request_positions_are_checked() -> None:
    def problem(*probes: stage_pb2.LogitProbe) -> str | None:
        return logit_probes.positions_problem(list(probes), tokens=4, vocab=VOCAB)

    assert problem(stage_pb2.LogitProbe(position=0), stage_pb2.LogitProbe(position=3)) is None
    assert "got 4 after -1" in (problem(stage_pb2.LogitProbe(position=4)) or "")
    assert "got 0 after 2" in (
        problem(stage_pb2.LogitProbe(position=2), stage_pb2.LogitProbe(position=0)) or ""
    )
    assert "outside the vocabulary" in (
        problem(stage_pb2.LogitProbe(position=0, token_ids=[VOCAB])) or ""
    )
