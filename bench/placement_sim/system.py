"""What every placement system under test offers the evaluator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from .regions import Site
from .swarm import Hop, SimNode, Swarm


class PlacementSystem(Protocol):
    name: str
    swarm: Swarm
    # The client computes the final norm and LM head on its CPU (Petals); otherwise the
    # last node of the route does, on its GPU (the embedding lookup costs next to nothing).
    client_runs_head: bool

    def start(self) -> None:
        """Place the model on every node now in `swarm`."""

    def join(self, node: SimNode, now_s: float) -> int:
        """`node` was added to the swarm; returns the weight bytes nodes fetch as a result."""

    def leave(self, node_id: str, now_s: float) -> int:
        """`node_id` was removed from the swarm; returns the weight bytes fetched."""

    def ranges(self) -> dict[str, tuple[int, int]]:
        """node id -> [start, end) of the layers it holds."""

    def route(self, client: Site, load: Mapping[str, int], full: set[str]) -> list[Hop] | None:
        """A path for a new session from `client`, or None when none can be served.

        `load` counts the sessions each node serves now; `full` holds the nodes without a
        free KV slot (a route through one of them is refused).
        """
