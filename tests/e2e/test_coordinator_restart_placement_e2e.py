"""A coordinator restart moves no shard, with real processes on loopback.

Before plans were saved, a restarted coordinator planned from scratch around the first node
to re-attach: with `--min-stages 3` it cut a one-stage layout, and every node fetched the
whole model again (gigabytes per node on a real swarm, for one deploy). Now it starts from
its saved plans and waits for the nodes those place to come back: each keeps its shard,
nothing is downloaded, and generation gives the same tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint
from support.swarms import three_stage_swarm
from support.waiting import wait_for

from client.api import Client
from client.errors import CoordinatorUnavailable
from client.local_swarm import LocalSwarm
from protos.tessera.v1 import node_pb2

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
SMALL = ("alpha", "bravo", "charlie")
NODES = (*SMALL, "delta")
SMALL_ARGS = ["--max-memory-gb", "0.003"]  # room for 2 of the 6 layers
PROMPT = [1, 5, 9, 23, 42, 7, 11]
BACK = "every node that was online before the restart is back"
ATTACHED = "offline -> online: attached"

Shards = dict[str, set[tuple[int, int, int]]]  # node id -> (start, end, state)


def shards(client: Client) -> Shards | None:
    try:
        nodes = client.nodes()
    except CoordinatorUnavailable:
        return None
    return {n.node_id: {(s.layers.start, s.layers.end, s.state) for s in n.shards} for n in nodes}


def settled_placement(client: Client, nodes: int, replicas: int, quiet_s: float = 3.0) -> Shards:
    """The shards every node holds once ``nodes`` are online, every layer has ``replicas``
    ready replicas, and nothing has changed for ``quiet_s``."""
    seen: list[tuple[float, Shards | None]] = [(time.monotonic(), None)]

    def quiet() -> bool:
        now = shards(client)
        info = {m.name: m for m in client.models()}.get(MODEL) if now is not None else None
        if not (now and len(now) == nodes and info and min(info.ready_replicas) >= replicas):
            seen[:] = [(time.monotonic(), None)]
            return False
        if now != seen[0][1]:
            seen[:] = [(time.monotonic(), now)]
            return False
        return time.monotonic() - seen[0][0] >= quiet_s

    wait_for(quiet, "the placement to settle", 120)
    placement = seen[0][1]
    assert placement is not None
    return placement


def fetches(swarm: LocalSwarm) -> int:
    return sum(p.log_text().count("shard_fetcher: model") for p in swarm.processes
               if p.name in NODES)  # fmt: skip


def test_a_restarted_coordinator_keeps_every_shard_in_place(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "tiny", "llama", num_layers=6, **TINY_SHAPE, seed=7)
    # Three small nodes get the 3-stage layout; a big one joins later and replicates it.
    # Planned afresh, the big one would take a stage: the layout has a history to keep.
    with three_stage_swarm(
        tmp_path / "swarm", checkpoint, MODEL, SMALL, node_args=SMALL_ARGS
    ) as swarm:
        address = swarm.address
        with Client(address) as client:
            first = settled_placement(client, len(SMALL), replicas=1)
            assert {(s, e) for held in first.values() for s, e, _ in held} == {
                (0, 2), (2, 4), (4, 6)
            }, f"the small nodes hold one stage each: {first}"  # fmt: skip
            big = swarm.start_node("delta")
            swarm.wait_registered([big])
            before = settled_placement(client, len(NODES), replicas=2)
            assert {k: v for k, v in before.items() if k != big.node_id} == first
            tokens = client.generate_all(
                MODEL, token_ids=PROMPT, max_new_tokens=8, stop_at_eos=False
            ).token_ids
        fetched = fetches(swarm)

        swarm.coordinator.kill9()
        swarm.start_coordinator(listen=address)
        # A crash loop: killed again as soon as the first node is back, so the database
        # has the others offline; the restarted one still waits for every node it placed.
        wait_for(lambda: ATTACHED in swarm.coordinator.log_text(), "a node to come back", 90)
        swarm.coordinator.kill9()
        swarm.start_coordinator(listen=address)
        wait_for(lambda: BACK in swarm.coordinator.log_text(), "the nodes to come back", 90)
        with Client(address) as client:
            after = settled_placement(client, len(NODES), replicas=2)
            assert after == before, "a node's shards changed across the restart"
            assert all(
                state == node_pb2.SHARD_STATE_READY for held in after.values() for *_, state in held
            )
            assert fetches(swarm) == fetched, "a node fetched weights after the restart"
            again = client.generate_all(
                MODEL, token_ids=PROMPT, max_new_tokens=8, stop_at_eos=False
            ).token_ids
        assert again == tokens
