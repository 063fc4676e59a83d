"""Churn traces are heavy-tailed, seeded and reproducible."""

import math
import random
import statistics

import pytest
from placement_sim.churn import (
    MEDIAN_SESSION_S,
    WEIBULL_SHAPE,
    churn_trace,
    initial_ages,
    mean_session_s,
    session_lengths,
)


def _trace(seed: int, events: int = 40):
    return churn_trace([f"n{i}" for i in range(30)], lambda nid: nid.upper(), events, seed)


def test_same_seed_same_trace_other_seed_other_trace():
    assert _trace(5) == _trace(5)
    assert _trace(5) != _trace(6)


def test_trace_is_ordered_and_consistent():
    trace = _trace(9, events=200)
    assert [e.time_s for e in trace] == sorted(e.time_s for e in trace)
    present = {f"n{i}" for i in range(30)}
    joins = leaves = 0
    for event in trace:
        if event.kind == "join":
            assert event.node == event.node_id.upper() and event.node_id not in present
            present.add(event.node_id)
            joins += 1
        else:
            assert event.node_id in present and event.node is None
            present.remove(event.node_id)
            leaves += 1
    assert joins > 50 and leaves > 50  # arrivals keep the swarm near its size


def test_session_lengths_have_the_documented_median_and_a_heavy_tail():
    lengths = session_lengths(random.Random(1), 20_000)
    assert abs(statistics.median(lengths) / MEDIAN_SESSION_S - 1) < 0.05
    # Weibull shape 0.5: the mean is (Gamma(3) / ln(2)^2) ~ 4.2x the median
    assert mean_session_s() / MEDIAN_SESSION_S == pytest.approx(math.gamma(3) / math.log(2) ** 2)
    assert WEIBULL_SHAPE < 1
    assert max(lengths) > 50 * MEDIAN_SESSION_S  # a few sessions last for days


def test_initial_ages_belong_to_the_sessions_the_trace_ends():
    """A node present at the start has been online for `initial_ages` and leaves at its
    first leave event: one in-progress session, drawn once. Heavy tails make the two
    correlated: nodes that have stayed long leave later, which the planner's reliability
    estimate relies on."""
    ids = [f"n{i}" for i in range(2000)]
    ages = initial_ages(ids, seed=3)
    assert ages == initial_ages(ids, seed=3) and all(a >= 0 for a in ages.values())
    trace = churn_trace(ids, lambda nid: nid, 2000, seed=3)
    left = {e.node_id for e in trace if e.kind == "leave" and e.node_id in ages}
    by_age = sorted(ages, key=ages.__getitem__)
    young, elder = by_age[: len(ids) // 2], by_age[len(ids) // 2 :]
    share = [sum(n in left for n in half) / len(half) for half in (young, elder)]
    assert 0 < share[1] and share[0] > 1.8 * share[1], share  # 0.38 against 0.17
