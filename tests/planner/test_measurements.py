"""Measured speed and RTT replace what a node claims, within a bounded number of
observations, and no observation sequence lets a node look faster than it was seen."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.measurements import MAX_CALL_SHARE, MAX_PEERS, MIN_SAMPLES, Measurements

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


@pytest.mark.parametrize(
    "layers, tokens, compute_ms",
    [
        (0, 1, 5.0),
        (4, 0, 5.0),
        (-4, 1, 5.0),
        (4, 1, -5.0),
        (4, 1, math.nan),
        (4, 1, math.inf),
    ],
)
def test_impossible_observations_are_ignored(layers, tokens, compute_ms):
    m = Measurements()
    m.observe_step(
        "n", layers=layers, params_per_layer=PARAMS, tokens=tokens, compute_ms=compute_ms
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


# ---- the fixed part of a call ------------------------------------------------------------

CALL_MS = 3.0  # what every call costs whatever its layers (framework, kernel launches)


def timed(m: Measurements, node: str, layers: int, *, call_ms: float = CALL_MS, tokens: int = 1):
    m.observe_step(
        node,
        layers=layers,
        params_per_layer=PARAMS,
        tokens=tokens,
        compute_ms=call_ms + TRUE_MS * layers * tokens,
    )


def test_the_fixed_part_of_a_call_is_told_apart_once_the_node_served_two_spans():
    m = Measurements()
    for _ in range(3 * MIN_SAMPLES):
        timed(m, "n", 8)
    # One span alone cannot tell a fixed part from a slope: per parameter, as before.
    assert m.call_ms("n") == 0.0
    assert m.layer_ms("n", PARAMS) == pytest.approx(TRUE_MS + CALL_MS / 8)
    for _ in range(6 * MIN_SAMPLES):  # a re-plan gave it 2 layers; the averages settle
        timed(m, "n", 2)
    assert m.call_ms("n") == pytest.approx(CALL_MS, rel=1e-6)
    assert m.layer_ms("n", PARAMS) == pytest.approx(TRUE_MS, rel=1e-6)
    assert m.of("n", PARAMS).call_ms == pytest.approx(CALL_MS, rel=1e-6)
    # Per parameter alone it looked 2.5x slower per layer on 2 layers than it is.
    assert m.mean_ms_per_gparam("n") * PARAMS / 1e9 == pytest.approx(TRUE_MS + CALL_MS / 2)


def test_batches_do_not_feed_the_fixed_part():
    """A batch reads each weight once for all its tokens: its time is not a point on the
    line of one token's call over its parameters."""
    m = Measurements()
    for tokens in [1, 8] * (2 * MIN_SAMPLES):
        timed(m, "n", 4, tokens=tokens)
    assert m.call_ms("n") == 0.0


def test_the_fixed_part_needs_min_samples_and_forget_drops_it():
    m = Measurements()
    for layers in [2, 8] * (MIN_SAMPLES // 2 - 1):
        timed(m, "n", layers)
    assert m.call_ms("n") == 0.0
    for layers in [2, 8]:
        timed(m, "n", layers)
    assert m.call_ms("n") > 0.0
    m.forget("n")
    assert m.call_ms("n") == 0.0 and m.work("n") == 0.0


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.integers(1, 32), st.floats(0.05, 500.0)),
        min_size=MIN_SAMPLES,
        max_size=4 * MIN_SAMPLES,
    )
)
def test_whatever_a_node_does_its_plan_time_at_its_recent_work_is_its_recent_mean(calls):
    """A node cannot pick its spans, only how long its calls take. Whatever the times, even
    a node that stalls small calls to look fast per layer: the fixed part stays within
    [0, MAX_CALL_SHARE] of its recent mean call, and fixed part + per-parameter time at its
    recent work is exactly that mean, so the split moves no time off what was seen."""
    m = Measurements()
    for layers, ms in calls:
        m.observe_step("n", layers=layers, params_per_layer=PARAMS, tokens=1, compute_ms=ms)
    work = m.work("n")
    mean_call = m.mean_ms_per_gparam("n") * work
    call = m.call_ms("n")
    assert 0.0 <= call <= MAX_CALL_SHARE * mean_call * (1 + 1e-9)
    assert call + m.ms_per_gparam("n") * work == pytest.approx(mean_call, rel=1e-9)
    assert m.ms_per_gparam("n") > 0.0


def test_the_fixed_part_is_kept_when_the_old_span_is_forgotten():
    m = Measurements()
    for layers in [8] * (3 * MIN_SAMPLES) + [2] * (3 * MIN_SAMPLES):
        timed(m, "n", layers)
    assert m.call_ms("n") == pytest.approx(CALL_MS, rel=1e-6)
    for _ in range(50 * MIN_SAMPLES):  # the 8-layer calls fade out of the fit
        timed(m, "n", 2)
    assert m._fit["n"].intercept() is None
    assert m.call_ms("n") == pytest.approx(CALL_MS, rel=1e-6)
    assert m.layer_ms("n", PARAMS) == pytest.approx(TRUE_MS, rel=1e-6)
    for _ in range(6 * MIN_SAMPLES):  # the card slows down 2x: the per-layer part follows
        m.observe_step("n", layers=2, params_per_layer=PARAMS, tokens=1,
                       compute_ms=CALL_MS + 2 * TRUE_MS * 2)  # fmt: skip
    assert m.call_ms("n") + 2 * m.layer_ms("n", PARAMS) == pytest.approx(CALL_MS + 4 * TRUE_MS)
