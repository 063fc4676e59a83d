"""Reconnect waits: exponential ceiling, full jitter below it, a cap, and a reset."""

import random

import pytest

from node_agent.backoff import BASE_ENV, CAP_ENV, Backoff, from_env


def test_the_ceiling_doubles_until_the_cap() -> None:
    backoff = Backoff(base_s=0.5, cap_s=30.0, rng=random.Random(1))
    ceilings = []
    for _ in range(10):
        ceilings.append(backoff.ceiling())
        backoff.next_delay()
    assert ceilings == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]


def test_delays_are_jittered_and_never_exceed_the_ceiling() -> None:
    backoff = Backoff(base_s=1.0, cap_s=8.0, rng=random.Random(7))
    for _ in range(3):
        backoff.next_delay()
    # From now on the ceiling is the cap: draws must spread over [0, cap].
    delays = [backoff.next_delay() for _ in range(400)]
    assert all(0.0 <= d <= 8.0 for d in delays)
    assert len(set(delays)) == len(delays)
    assert min(delays) < 1.0 and max(delays) > 7.0
    assert 3.0 < sum(delays) / len(delays) < 5.0  # full jitter: mean about cap / 2


def test_delays_grow_on_average() -> None:
    rng = random.Random(3)
    means = []
    for attempt in range(5):
        samples = []
        for _ in range(300):
            backoff = Backoff(base_s=0.1, cap_s=100.0, rng=rng, attempt=attempt)
            samples.append(backoff.next_delay())
        means.append(sum(samples) / len(samples))
    assert means == sorted(means)
    assert means[-1] > 8 * means[0]


def test_huge_attempt_counts_stay_at_the_cap() -> None:
    assert Backoff(base_s=0.5, cap_s=30.0, attempt=10_000).ceiling() == 30.0


def test_reset_starts_over() -> None:
    backoff = Backoff(base_s=0.5, cap_s=30.0)
    for _ in range(5):
        backoff.next_delay()
    backoff.reset()
    assert backoff.ceiling() == 0.5


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="0 < base"):
        Backoff(base_s=0.0, cap_s=1.0)
    with pytest.raises(ValueError, match="<= cap"):
        Backoff(base_s=2.0, cap_s=1.0)


def test_environment_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BASE_ENV, "0.01")
    monkeypatch.setenv(CAP_ENV, "0.2")
    assert (from_env().base_s, from_env().cap_s) == (0.01, 0.2)
    flagged = from_env(base_s=0.05, cap_s=1.0)
    assert (flagged.base_s, flagged.cap_s) == (0.05, 1.0)
