"""The training driver's per-node step deadlines (client/training_deadlines.py)."""

from __future__ import annotations

import pytest

from client.training_deadlines import StepDeadlines


def deadlines() -> StepDeadlines:
    return StepDeadlines(cold_s=300.0, floor_s=30.0, factor=8.0, recent=4)


def test_a_node_gets_the_cold_timeout_until_it_has_answered_twice() -> None:
    d = deadlines()
    assert d.timeout("a", "ForwardTrain") == 300.0
    d.answered("a", "ForwardTrain", 0.5)
    assert d.timeout("a", "ForwardTrain") == 300.0
    d.answered("a", "ForwardTrain", 0.4)
    assert d.timeout("a", "ForwardTrain") == 30.0  # 8 x 0.5 s is under the floor
    # Per node and per kind of call: neither another node nor another call is timed yet.
    assert d.timeout("b", "ForwardTrain") == 300.0
    assert d.timeout("a", "BackwardTrain") == 300.0


def test_the_deadline_follows_the_slowest_recent_answer_and_the_cold_timeout_caps_it() -> None:
    d = deadlines()
    for wall in (60.0, 5.0, 5.0):  # a slow first call (kernels compiling), then steady
        d.answered("a", "BackwardTrain", wall)
    assert d.timeout("a", "BackwardTrain") == 300.0  # 8 x 60 s, capped
    for _ in range(2):
        d.answered("a", "BackwardTrain", 5.0)
    assert d.timeout("a", "BackwardTrain") == 40.0  # the 60 s call is no longer recent


def test_calls_whose_cost_does_not_repeat_keep_the_cold_timeout() -> None:
    d = deadlines()
    for method in ("OpenTraining", "SaveCheckpoint"):
        for _ in range(3):
            d.answered("a", method, 0.1)
        assert d.timeout("a", method) == 300.0


def test_a_shadow_gets_patience_in_proportion_to_the_primary() -> None:
    d = deadlines()
    assert d.patience(0.01) == 30.0
    assert d.patience(10.0) == 80.0
    assert d.patience(100.0) == 300.0


def test_a_cold_timeout_under_the_floor_caps_every_deadline() -> None:
    d = StepDeadlines(cold_s=10.0, floor_s=30.0, factor=8.0)
    for _ in range(2):
        d.answered("a", "GradNorm", 0.01)
    assert d.timeout("a", "GradNorm") == 10.0 and d.patience(0.01) == 10.0


@pytest.mark.parametrize(
    ("cold", "floor", "factor"), [(300.0, 0.0, 8.0), (0.0, 30.0, 8.0), (300.0, 30.0, 0.5)]
)
def test_nonsense_settings_are_refused(cold: float, floor: float, factor: float) -> None:
    with pytest.raises(ValueError, match="step deadlines need"):
        StepDeadlines(cold_s=cold, floor_s=floor, factor=factor)
