"""Real-process swarms on loopback for end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from client.local_swarm import LocalSwarm


@contextmanager
def three_stage_swarm(
    work: Path, checkpoint: Path, model: str, nodes: Sequence[str]
) -> Iterator[LocalSwarm]:
    """A coordinator that splits models into 3 stages with 2 replicas of each (heartbeats
    every second), the named node agents, and ``checkpoint`` imported as ``model``."""
    with LocalSwarm(
        work, coordinator_args=["--min-stages", "3", "--replicas", "2", "--heartbeat-interval", "1"]
    ) as s:
        s.start_coordinator()
        procs = [s.start_node(name) for name in nodes]
        s.wait_registered(procs)
        s.add_model(checkpoint, model)
        yield s
