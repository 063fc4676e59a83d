"""Measured speed, queueing and RTT replace what a node claims, within a bounded number of
observations, and no observation sequence lets a node look faster than it was seen."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.measurements import MAX_PEERS, MIN_SAMPLES, Measurements

PARAMS = 200_000_000  # a 7B-sized layer
TRUE_MS = 0.6  # per layer and token: 3.0 ms per billion parameter-tokens


def step(m: Measurements, node: str, ms_per_layer: float, layers: int = 8, tokens: int = 1):
    m.observe_step(
        node,
        layers=layers,
        params_per_layer=PARAMS,
        tokens=tokens,
        compute_ms=ms_per_layer * layers * tokens,
    )


def test_a_node_claiming_ten_times_its_speed_is_corrected_by_its_first_observation():
    m = Measurements()
    claimed = TRUE_MS / 10
    assert m.layer_ms("liar", PARAMS, claimed) == claimed  # nothing observed: the claim
    step(m, "liar", TRUE_MS)
    assert m.layer_ms("liar", PARAMS, claimed) == pytest.approx(TRUE_MS)
    for _ in range(MIN_SAMPLES):
        step(m, "liar", TRUE_MS)
    measured = m.of("liar", PARAMS, claimed)
    assert measured.measured and measured.layer_ms == pytest.approx(TRUE_MS)


@settings(max_examples=200, deadline=None)
@given(
    claim_factor=st.floats(0.1, 100.0),
    noise=st.lists(st.floats(0.8, 1.2), min_size=MIN_SAMPLES, max_size=3 * MIN_SAMPLES),
)
def test_the_bound_on_observations_holds_for_any_claim_and_noisy_traffic(claim_factor, noise):
    """After MIN_SAMPLES observations within +-20 % of the truth, the estimate is within
    20 % of the truth whatever the node claimed; at every step it is never faster than the
    fastest observation, unless the node claimed to be slower than that."""
    m = Measurements()
    claimed = TRUE_MS / claim_factor
    for i, factor in enumerate(noise, start=1):
        step(m, "n", TRUE_MS * factor)
        estimate = m.layer_ms("n", PARAMS, claimed)
        assert estimate >= min(TRUE_MS * f for f in noise[:i]) * (1 - 1e-9)
        if i >= MIN_SAMPLES:
            assert abs(estimate / TRUE_MS - 1) <= 0.2 + 1e-9


def test_an_under_claiming_node_gets_its_real_speed_after_min_samples():
    m = Measurements()
    for _ in range(MIN_SAMPLES):
        assert m.layer_ms("modest", PARAMS, TRUE_MS * 3) == TRUE_MS * 3  # not yet: the claim
        step(m, "modest", TRUE_MS)
    assert m.layer_ms("modest", PARAMS, TRUE_MS * 3) == pytest.approx(TRUE_MS)


def test_a_node_that_slows_down_is_tracked_within_six_samples():
    m = Measurements()
    for _ in range(MIN_SAMPLES):
        step(m, "n", TRUE_MS)
    for _ in range(6):
        step(m, "n", 3 * TRUE_MS)
    assert m.layer_ms("n", PARAMS) == pytest.approx(3 * TRUE_MS, rel=0.1)


def test_one_stall_does_not_become_the_nodes_speed():
    m = Measurements()
    for _ in range(MIN_SAMPLES):
        step(m, "n", TRUE_MS)
    step(m, "n", 1000 * TRUE_MS)  # a 10 s pause: clamped to 4x before averaging
    assert m.layer_ms("n", PARAMS) <= TRUE_MS * (1 + 0.3 * 3) + 1e-12


def test_speed_is_per_parameter_so_one_average_serves_every_model():
    m = Measurements()
    for _ in range(MIN_SAMPLES):
        step(m, "n", TRUE_MS, tokens=4)
    assert m.layer_ms("n", PARAMS * 4) == pytest.approx(TRUE_MS * 4)  # a 4x larger layer


def test_queueing_is_averaged_and_reported():
    m = Measurements()
    for q in (10.0, 10.0, 40.0):
        m.observe_step("n", layers=1, params_per_layer=PARAMS, tokens=1, compute_ms=1, queue_ms=q)
    assert 10.0 < m.of("n", PARAMS).queue_ms < 40.0


@pytest.mark.parametrize(
    "layers, tokens, compute_ms, queue_ms",
    [
        (0, 1, 5.0, 0.0),
        (4, 0, 5.0, 0.0),
        (-4, 1, 5.0, 0.0),
        (4, 1, -5.0, 0.0),
        (4, 1, math.nan, 0.0),
        (4, 1, math.inf, 0.0),
        (4, 1, 5.0, -1.0),
        (4, 1, 5.0, math.nan),
    ],
)
def test_impossible_observations_are_ignored(layers, tokens, compute_ms, queue_ms):
    m = Measurements()
    m.observe_step(
        "n",
        layers=layers,
        params_per_layer=PARAMS,
        tokens=tokens,
        compute_ms=compute_ms,
        queue_ms=queue_ms,
    )
    assert m.of("n", PARAMS, 1.5).layer_ms == 1.5 and m.of("n", PARAMS).samples == 0


def test_rtt_is_the_median_over_peers_and_pairs_average_both_directions():
    m = Measurements()
    m.observe_rtts("a", {"b": 20.0, "c": 30.0, "d": 200.0, "a": 0.0})  # self ignored
    m.observe_rtt("b", "a", 40.0)
    m.observe_rtt("a", "e", math.nan)
    m.observe_rtt("a", "e", -3.0)
    assert m.rtt_ms("a") == 30.0
    assert m.pair_rtt_ms("a", "b") == pytest.approx(30.0)
    assert m.pair_rtt_ms("a", "d") == 200.0
    assert m.pair_rtt_ms("c", "d") is None
    assert m.rtt_ms("nobody") == 0.0


def test_a_node_reporting_endless_peers_is_bounded_and_forget_drops_it():
    m = Measurements()
    m.observe_rtts("spam", {f"p{i}": 10.0 for i in range(10 * MAX_PEERS)})
    assert len(m._rtt["spam"]) == MAX_PEERS
    m.observe_rtt("b", "spam", 5.0)
    step(m, "spam", TRUE_MS)
    m.forget("spam")
    assert "spam" not in m.known() and m.pair_rtt_ms("b", "spam") is None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Measurements(min_samples=0)
    with pytest.raises(ValueError):
        Measurements(alpha=1.5)
