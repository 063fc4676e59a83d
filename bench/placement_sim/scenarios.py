"""The swarms every system is measured on: card mix, regions, size, model and churn."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .churn import ChurnEvent, churn_trace, initial_ages
from .gpus import GPUS, MIXES
from .models import LLAMA2_7B, LLAMA2_13B, LLAMA2_70B, ModelShape
from .regions import REGIONS, Site, draw_access
from .swarm import SimNode

EVERYWHERE = {"us-east": 0.3, "us-west": 0.15, "eu-west": 0.2, "eu-central": 0.2, "asia-east": 0.15}
NORTH_ATLANTIC = {"us-east": 0.4, "us-west": 0.15, "eu-west": 0.25, "eu-central": 0.2}
EUROPE = {"eu-west": 0.5, "eu-central": 0.5}
US_EAST = {"us-east": 1.0}


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelShape
    nodes: int
    mix: str
    regions: dict[str, float]
    churn_events: int
    seed: int

    def _site(self, rng: random.Random) -> Site:
        names = list(self.regions)
        region = rng.choices(names, weights=[self.regions[r] for r in names])[0]
        assert region in REGIONS
        return Site(region, draw_access(rng))

    def _node(self, node_id: str, rng: random.Random) -> SimNode:
        mix = MIXES[self.mix]
        cards = list(mix)
        gpu = GPUS[rng.choices(cards, weights=[mix[c] for c in cards])[0]]
        return SimNode(node_id, gpu, self._site(rng))

    def build_nodes(self) -> list[SimNode]:
        """The swarm at the start, each node online for as long as the churn trace says."""
        rng = random.Random(self.seed)
        nodes = [self._node(f"n{i:05d}", rng) for i in range(self.nodes)]
        ages = initial_ages([n.node_id for n in nodes], self.seed)
        return [replace(n, joined_s=-ages[n.node_id]) for n in nodes]

    def clients(self, count: int) -> list[Site]:
        rng = random.Random(self.seed + 1)
        return [self._site(rng) for _ in range(count)]

    def churn(self) -> list[ChurnEvent[SimNode]]:
        """Leaves and joins; a joining node's `joined_s` is its event's time."""
        rng = random.Random(self.seed + 2)
        ids = [f"n{i:05d}" for i in range(self.nodes)]
        trace = churn_trace(ids, lambda nid: self._node(nid, rng), self.churn_events, self.seed)
        return [
            replace(e, node=replace(e.node, joined_s=e.time_s)) if e.node is not None else e
            for e in trace
        ]


FULL = [
    Scenario("7b-us-east-steam", LLAMA2_7B, 48, "steam", US_EAST, 16, 11),
    Scenario("13b-atlantic-steam", LLAMA2_13B, 96, "steam", NORTH_ATLANTIC, 16, 12),
    Scenario("13b-global-lowmem", LLAMA2_13B, 128, "low-memory", EVERYWHERE, 16, 13),
    Scenario("70b-europe-highend", LLAMA2_70B, 64, "high-end", EUROPE, 16, 14),
    Scenario("70b-global-steam", LLAMA2_70B, 160, "steam", EVERYWHERE, 16, 15),
]


def quick(scenarios: list[Scenario]) -> list[Scenario]:
    """Smaller swarms and shorter traces, same shapes: for a fast look."""
    return [replace(s, nodes=max(16, s.nodes // 3), churn_events=6) for s in scenarios]
