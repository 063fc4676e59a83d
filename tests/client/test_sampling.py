"""Sampling: greedy is argmax, temperature/top-p are seeded per position and stay inside the
nucleus."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from client.sampling import Sampler, SamplingParams, sample
from protos.sampling import MAX_SEED, draw_at

finite_logits = arrays(
    np.float32,
    st.integers(1, 50),
    elements=st.floats(-30, 30, width=32, allow_nan=False, allow_infinity=False),
)


@settings(max_examples=200, deadline=None)
@given(finite_logits)
def test_greedy_is_argmax(logits) -> None:
    assert sample(logits, SamplingParams(), np.random.default_rng(0)) == int(np.argmax(logits))


@settings(max_examples=200, deadline=None)
@given(finite_logits, st.floats(0.05, 3.0), st.floats(0.01, 1.0), st.integers(0, 2**32 - 1))
def test_sampled_token_is_in_range_and_in_the_nucleus(logits, temperature, top_p, seed) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    token = sample(logits, params, np.random.default_rng(seed))
    assert 0 <= token < logits.size
    # The token's probability mass rank must be inside the smallest set reaching top_p.
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    better = probs[probs > probs[token]].sum()
    assert better < top_p + 1e-9


def test_same_seed_same_draws_different_seed_differs() -> None:
    logits = np.linspace(0.0, 1.0, 64, dtype=np.float32)
    params = SamplingParams(temperature=1.0, seed=123)
    one, two = Sampler(params), Sampler(params)
    run_one = [one(logits, position) for position in range(30)]
    run_two = [two(logits, position) for position in range(30)]
    assert run_one == run_two
    assert len(set(run_one)) > 5  # positions draw apart, not one token 30 times
    other = Sampler(SamplingParams(temperature=1.0, seed=124))
    assert [other(logits, position) for position in range(30)] != run_one


def test_a_draw_depends_on_its_position_only_not_on_earlier_draws() -> None:
    # What lets a node that runs the ring, or a client after a rollback, draw the token
    # a fresh run draws at that position.
    logits = np.linspace(-2.0, 2.0, 100, dtype=np.float32)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    forward = [draw_at(logits, params, position) for position in range(40)]
    backward = [draw_at(logits, params, position) for position in reversed(range(40))]
    assert forward == backward[::-1]
    assert Sampler(params)(logits, 17) == forward[17]


def test_an_unseeded_sampler_picks_a_seed_it_can_hand_on() -> None:
    logits = np.linspace(0.0, 1.0, 64, dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0))
    assert sampler.params.seed is not None and 0 <= sampler.params.seed <= MAX_SEED
    draws = [sampler(logits, position) for position in range(20)]
    assert draws == [draw_at(logits, sampler.params, position) for position in range(20)]


def test_tiny_top_p_is_greedy() -> None:
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=0))
    assert {sampler(logits, position) for position in range(50)} == {1}


def test_temperature_follows_the_distribution() -> None:
    logits = np.log(np.array([0.7, 0.2, 0.1], dtype=np.float64)).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    counts = np.bincount([sampler(logits, p) for p in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.7, 0.2, 0.1], atol=0.03)


def test_infinite_logits_are_masked_and_all_bad_is_an_error() -> None:
    logits = np.array([-np.inf, 1.0, np.nan], dtype=np.float32)
    assert sample(logits, SamplingParams(), np.random.default_rng(0)) == 1
    assert sample(logits, SamplingParams(temperature=1.0), np.random.default_rng(0)) == 1
    with pytest.raises(ValueError, match="garbage"):
        sample(np.array([np.nan, np.inf], dtype=np.float32), SamplingParams(), None)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"temperature": np.nan},
        {"seed": -5},
        {"seed": MAX_SEED + 1},
        {"top_p": np.nan},
    ],
)
def test_bad_parameters_are_refused_by_name(params) -> None:
    (name,) = params
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams(**params)


def test_logits_must_be_a_vector() -> None:
    with pytest.raises(ValueError, match="1-D"):
        sample(np.zeros((2, 3), dtype=np.float32), SamplingParams(), np.random.default_rng(0))
