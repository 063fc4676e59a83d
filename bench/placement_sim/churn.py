"""Seeded churn traces: who leaves and who joins, and when.

Session lengths are heavy-tailed. Stutzbach & Rejaie ("Understanding Churn in
Peer-to-Peer Networks", IMC 2006) measured Gnutella, Kad and BitTorrent and found that
session lengths fit a Weibull distribution with shape well below 1 (most sessions are
short, a few last for days) far better than an exponential. We use shape 0.5 and scale the
distribution so that the median session lasts one hour: GPU volunteers stay longer than
file sharers, which is our assumption, not a measurement.

Arrivals are a Poisson process whose rate keeps the swarm at its starting size on average
(rate = size / mean session). Nodes present at the start are a snapshot of a swarm in
steady state, so their remaining time is the *residual* life: a length-biased session
(long sessions are more likely to be in progress) times a uniform fraction. Drawing fresh
sessions instead would make a burst of departures in the first seconds that no real swarm
shows.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

WEIBULL_SHAPE = 0.5
MEDIAN_SESSION_S = 3600.0

T = TypeVar("T")


def weibull_scale_for_median(median_s: float, shape: float) -> float:
    return median_s / math.log(2.0) ** (1.0 / shape)


def mean_session_s(median_s: float = MEDIAN_SESSION_S, shape: float = WEIBULL_SHAPE) -> float:
    return weibull_scale_for_median(median_s, shape) * math.gamma(1.0 + 1.0 / shape)


def session_in_progress(
    rng: random.Random, median_s: float = MEDIAN_SESSION_S, shape: float = WEIBULL_SHAPE
) -> tuple[float, float]:
    """(time online so far, remaining time) of a session seen in progress at a random
    moment.

    A length-biased Weibull(shape, scale) session is scale * G^(1/shape) with
    G ~ Gamma(1 + 1/shape, 1); the moment we look at is uniform within it.
    """
    scale = weibull_scale_for_median(median_s, shape)
    biased = scale * rng.gammavariate(1.0 + 1.0 / shape, 1.0) ** (1.0 / shape)
    remaining = rng.random() * biased
    return biased - remaining, remaining


def residual_lifetime(
    rng: random.Random, median_s: float = MEDIAN_SESSION_S, shape: float = WEIBULL_SHAPE
) -> float:
    """Remaining time of a session seen in progress at a random moment."""
    return session_in_progress(rng, median_s, shape)[1]


def initial_ages(
    initial_ids: list[str],
    seed: int,
    median_s: float = MEDIAN_SESSION_S,
    shape: float = WEIBULL_SHAPE,
) -> dict[str, float]:
    """How long each node present at the start has been online: the other half of the
    draw that gives `churn_trace` its remaining time (same seed, same order), so a node's
    age and its remaining time are those of one session. With shape < 1 they are
    correlated: a node that has stayed long tends to stay longer (what the coordinator's
    reliability estimate assumes)."""
    rng = random.Random(seed)
    return {node_id: session_in_progress(rng, median_s, shape)[0] for node_id in initial_ids}


def session_lengths(
    rng: random.Random,
    count: int,
    median_s: float = MEDIAN_SESSION_S,
    shape: float = WEIBULL_SHAPE,
) -> list[float]:
    scale = weibull_scale_for_median(median_s, shape)
    return [rng.weibullvariate(scale, shape) for _ in range(count)]


@dataclass(frozen=True)
class ChurnEvent(Generic[T]):
    time_s: float
    kind: str  # "leave" or "join"
    node_id: str
    node: T | None = None  # the joining node; None for a leave


def churn_trace(
    initial_ids: list[str],
    make_node: Callable[[str], T],
    events: int,
    seed: int,
    median_s: float = MEDIAN_SESSION_S,
    shape: float = WEIBULL_SHAPE,
) -> list[ChurnEvent[T]]:
    """The first `events` leaves and joins of a swarm that starts with `initial_ids`."""
    rng = random.Random(seed)
    scale = weibull_scale_for_median(median_s, shape)
    arrival_rate = len(initial_ids) / mean_session_s(median_s, shape)
    queue: list[tuple[float, int, str, str]] = []  # (time, tiebreak, kind, node id)
    order = 0
    for node_id in initial_ids:
        remaining = residual_lifetime(rng, median_s, shape)
        heapq.heappush(queue, (remaining, order, "leave", node_id))
        order += 1
    next_join = rng.expovariate(arrival_rate)
    joined = 0
    trace: list[ChurnEvent[T]] = []
    while len(trace) < events:
        if queue and queue[0][0] <= next_join:
            time_s, _, kind, node_id = heapq.heappop(queue)
            trace.append(ChurnEvent(time_s, kind, node_id))
            continue
        joined += 1
        node_id = f"j{seed}-{joined:04d}"
        trace.append(ChurnEvent(next_join, "join", node_id, make_node(node_id)))
        heapq.heappush(
            queue, (next_join + rng.weibullvariate(scale, shape), order, "leave", node_id)
        )
        order += 1
        next_join += rng.expovariate(arrival_rate)
    return trace
