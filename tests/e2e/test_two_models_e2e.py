"""Two models share one swarm of real node agents: both are served, on different nodes.

Before the planner shared the swarm by demand, the first model's pipelines took every
node and the second model was never placed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint, transformers_greedy
from support.waiting import wait_for

from client.api import Client
from client.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow

PROMPT = [1, 5, 9, 23, 42, 7, 11]
NEW_TOKENS = 12
MODELS = {"tiny-llama": ("llama", 7), "tiny-qwen": ("qwen2", 8)}


def served(client: Client, name: str) -> bool:
    info = {m.name: m for m in client.models()}.get(name)
    return bool(info and info.available and min(info.ready_replicas) >= 1)


def test_two_models_are_both_served_by_their_own_nodes(tmp_path: Path) -> None:
    checkpoints = {
        name: make_checkpoint(
            tmp_path / name,
            arch,
            num_layers=4,
            **TINY_SHAPE,
            seed=seed,
        )
        for name, (arch, seed) in MODELS.items()
    }
    expected = {
        name: transformers_greedy(path, [PROMPT], NEW_TOKENS)[0]
        for name, path in checkpoints.items()
    }
    assert expected["tiny-llama"] != expected["tiny-qwen"]
    with LocalSwarm(tmp_path / "swarm", coordinator_args=["--heartbeat-interval", "1"]) as swarm:
        swarm.start_coordinator()
        nodes = [swarm.start_node(name) for name in ("alpha", "bravo", "charlie", "delta")]
        swarm.wait_registered(nodes)
        for name, path in checkpoints.items():
            swarm.add_model(path, name)
        with Client(swarm.address) as client:
            for name in MODELS:
                wait_for(lambda name=name: served(client, name), f"{name} to be served", 90)
            routes = {}
            for name in MODELS:
                result = client.generate_all(
                    name, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
                )
                assert result.token_ids == expected[name], name
                routes[name] = {hop.node_id for hop in result.route}
    # Each node serves one model: its KV slots and compute are not shared.
    assert not routes["tiny-llama"] & routes["tiny-qwen"], routes
