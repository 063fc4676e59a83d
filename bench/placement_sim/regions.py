"""Where nodes and clients sit, and the round-trip time between any two of them.

RTT(a, b) = backbone RTT between their regions + the access-line RTT of each end.

Backbone: median inter-region round trips between cloud regions, rounded to 5 ms, as
published by the public cloud latency tables (AWS inter-region medians collected by
cloudping.co; Azure's "network round-trip latency statistics" page, measured by
ThousandEyes). Regions map to us-east-1 (Virginia), us-west-1 (N. California), eu-west-1
(Ireland), eu-central-1 (Frankfurt) and ap-northeast-1 (Tokyo). Within one region two
homes are ~10 ms apart across the backbone (a metro area is smaller than a region).

Access lines: the first-hop RTT that the FCC's Measuring Broadband America reports put at
~10 ms for fiber, ~20 ms for cable and ~25-30 ms for DSL; each end of a path contributes
half, plus a few ms of per-home spread. Upload rates are typical plan tiers (fiber
symmetric, cable and DSL far slower up than down).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

REGIONS = ("us-east", "us-west", "eu-west", "eu-central", "asia-east")

_BACKBONE_MS = {
    ("us-east", "us-east"): 10,
    ("us-west", "us-west"): 10,
    ("eu-west", "eu-west"): 10,
    ("eu-central", "eu-central"): 10,
    ("asia-east", "asia-east"): 10,
    ("us-east", "us-west"): 65,
    ("us-east", "eu-west"): 70,
    ("us-east", "eu-central"): 90,
    ("us-east", "asia-east"): 150,
    ("us-west", "eu-west"): 130,
    ("us-west", "eu-central"): 145,
    ("us-west", "asia-east"): 105,
    ("eu-west", "eu-central"): 25,
    ("eu-west", "asia-east"): 210,
    ("eu-central", "asia-east"): 225,
}


def backbone_rtt_ms(a: str, b: str) -> float:
    return float(_BACKBONE_MS.get((a, b), _BACKBONE_MS.get((b, a))))


@dataclass(frozen=True)
class AccessLine:
    kind: str
    rtt_ms: float  # this end's share of a round trip
    up_mbps: float
    down_mbps: float


# kind -> (share of homes, half of the first-hop RTT, upload Mb/s, download Mb/s)
ACCESS_KINDS = {
    "fiber": (0.40, 5.0, 300.0, 500.0),
    "cable": (0.45, 10.0, 20.0, 300.0),
    "dsl": (0.15, 14.0, 10.0, 50.0),
}


def draw_access(rng: random.Random) -> AccessLine:
    kinds = list(ACCESS_KINDS)
    kind = rng.choices(kinds, weights=[ACCESS_KINDS[k][0] for k in kinds])[0]
    _, rtt, up, down = ACCESS_KINDS[kind]
    return AccessLine(kind, rtt + rng.uniform(0.0, 4.0), up, down)


@dataclass(frozen=True)
class Site:
    """A place on the network: a node's or a client's region and access line."""

    region: str
    access: AccessLine


def rtt_ms(a: Site, b: Site) -> float:
    return backbone_rtt_ms(a.region, b.region) + a.access.rtt_ms + b.access.rtt_ms


def rtt_matrix_ms(sites: list[Site]) -> np.ndarray:
    """Pairwise RTTs; the diagonal is 0 (a node does not talk to itself over the network)."""
    index = {r: i for i, r in enumerate(REGIONS)}
    backbone = np.array([[backbone_rtt_ms(a, b) for b in REGIONS] for a in REGIONS])
    regions = np.array([index[s.region] for s in sites], dtype=np.int64)
    access = np.array([s.access.rtt_ms for s in sites])
    matrix = backbone[np.ix_(regions, regions)] + access[:, None] + access[None, :]
    np.fill_diagonal(matrix, 0.0)
    return matrix
