"""A cheap cheater is checked even on a prefer=cheap route: real coordinator, real node
agents on loopback, misbehaviour from TESSERA_FAILPOINTS.

The cheater asks the lowest price, so a cheap route makes it the primary of the whole
model and trims both dearer honest replicas from its alternates. They come back as the
stage's verification-only checkers: the cheater's outputs are checked, the coordinator's
arbiter (the third operator) proves the fraud and bans it, and every generation equals
the honest output (transformers' reference).
"""

from __future__ import annotations

import os

import pytest
from support.market import funded_client
from verification.test_verification_e2e import (
    MODEL,
    NEW_TOKENS,
    PROMPTS,
    checkpoint,
    ready_everywhere,
    references,
    state_of,
    wait_for,
)

from client.api import Client
from client.local_swarm import LocalProcess, LocalSwarm
from node_agent.failpoints import ENV_VAR
from protos.tessera.v1 import node_pb2

pytestmark = pytest.mark.slow

__all__ = ["checkpoint", "references"]  # module fixtures shared with the e2e tests

# name: (operator account, price per 1,000 token-layers, failpoints)
NODES = {
    "cheater": ("op-c", 1, "corrupt=0.5,seed=2"),
    "honest-d": ("op-d", 500, ""),
    "honest-e": ("op-e", 600, ""),
}


def start_priced(swarm: LocalSwarm, name: str) -> LocalProcess:
    account, price, spec = NODES[name]
    os.environ.pop(ENV_VAR, None)
    if spec:
        os.environ[ENV_VAR] = spec  # the swarm copies this environment into the child
    try:
        return swarm.start_node(name, ["--account", account, "--price", str(price)])
    finally:
        os.environ.pop(ENV_VAR, None)


def test_a_cheap_corrupting_primary_is_checked_caught_and_banned(
    tmp_path, checkpoint, references
) -> None:
    args = [
        "--min-stages", "1", "--replicas", "3", "--heartbeat-interval", "1",
        "--verify-warmup", "100000", "--canary-interval", "0",
    ]  # fmt: skip
    with LocalSwarm(tmp_path, coordinator_args=args) as swarm:
        swarm.start_coordinator()
        nodes = {name: start_priced(swarm, name) for name in NODES}
        swarm.wait_registered(list(nodes.values()))
        swarm.add_model(checkpoint, MODEL)
        cheater = nodes["cheater"].node_id
        honest = {nodes["honest-d"].node_id, nodes["honest-e"].node_id}
        key = funded_client(swarm)  # a paid session: prices make the route cheap or not
        with Client(swarm.address, timeout_s=60, prefer="cheap", key=key) as client:
            wait_for(lambda: ready_everywhere(client, 3), "every node to serve the whole model")
            checkers: set[str] = set()
            for generation in range(4):
                prompt = PROMPTS[generation % len(PROMPTS)]
                result = client.generate_all(
                    MODEL, token_ids=prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False
                )
                assert result.token_ids == references[tuple(prompt)], generation
                stats = result.verification
                assert stats is not None
                checkers |= {c for p, c in stats.pairs if p == cheater}
                if state_of(client, cheater) == node_pb2.NODE_STATE_BANNED:
                    break
            assert state_of(client, cheater) == node_pb2.NODE_STATE_BANNED
        # The cheater was checked by the replicas the cheap route trimmed.
        assert checkers and checkers <= honest, checkers
        assert f"FRAUD PROVEN: node {cheater}" in swarm.coordinator.log_text()
