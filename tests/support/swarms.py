"""Real-process swarms on loopback for end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from client.local_swarm import LocalSwarm


@contextmanager
def three_stage_swarm(
    work: Path,
    checkpoint: Path,
    model: str,
    nodes: Sequence[str],
    coordinator_args: Sequence[str] = (),
    node_args: Sequence[str] = (),
) -> Iterator[LocalSwarm]:
    """A coordinator that splits models into 3 stages with 2 replicas of each (heartbeats
    every second; more flags in ``coordinator_args``), the named node agents (with
    ``node_args``), and ``checkpoint`` imported as ``model``."""
    args = ["--min-stages", "3", "--replicas", "2", "--heartbeat-interval", "1"]
    with LocalSwarm(work, coordinator_args=[*args, *coordinator_args]) as s:
        s.start_coordinator()
        procs = [s.start_node(name, node_args) for name in nodes]
        s.wait_registered(procs)
        s.add_model(checkpoint, model)
        yield s
