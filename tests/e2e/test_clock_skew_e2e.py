"""Nodes whose clocks are hours off still serve: real processes.

Volunteers' PCs keep bad time (no NTP, a dual-boot machine whose hardware clock holds
local time). A capability expires by the coordinator's clock, which the node learns when
it registers; before, a node whose clock ran an hour or more ahead found every capability
expired at once and refused every call (UNAUTHENTICATED), so it never served. The skew
comes from the failpoint `clock_skew_s` (node_agent/failpoints.py): the node's own clock
reads that far off, everything else is the real agent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint, transformers_greedy

from client.api import Client
from client.local_swarm import LocalSwarm, wait_for_replicas
from node_agent import failpoints

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPT = [1, 5, 9, 23, 42, 7, 11]
NEW_TOKENS = 10
# Two nodes two hours ahead, one two hours behind: with two replicas of every layer on
# three nodes, every route goes through a node whose clock is ahead.
SKEWS = {"alpha": 7200, "bravo": 7200, "charlie": -7200}


def test_nodes_whose_clocks_are_hours_off_serve_and_say_so(tmp_path: Path, monkeypatch) -> None:
    checkpoint = make_checkpoint(tmp_path / "tiny", "llama", num_layers=6, **TINY_SHAPE, seed=3)
    (reference,) = transformers_greedy(checkpoint, [PROMPT], NEW_TOKENS)
    with LocalSwarm(
        tmp_path / "swarm", coordinator_args=["--min-stages", "3", "--replicas", "2"]
    ) as swarm:
        swarm.start_coordinator()
        nodes = []
        for name, skew in SKEWS.items():
            monkeypatch.setenv(failpoints.ENV_VAR, f"clock_skew_s={skew}")
            nodes.append(swarm.start_node(name))
        monkeypatch.delenv(failpoints.ENV_VAR)
        assert failpoints.ENV_VAR not in os.environ
        swarm.wait_registered(nodes)
        swarm.add_model(checkpoint, MODEL)
        with Client(swarm.address) as client:
            wait_for_replicas(client, MODEL, timeout_s=120)
            result = client.generate_all(
                MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
            )
            assert result.token_ids == reference
            assert not result.failovers  # no node refused a call
            used = {hop.node_id for hop in result.initial_route}
        ahead = {p.node_id for p in nodes if SKEWS[p.name] > 0}
        assert used & ahead
        for proc in nodes:
            log = proc.log_text()
            words = "ahead of" if SKEWS[proc.name] > 0 else "behind"
            assert f"this machine's clock is 7200 s {words} the coordinator's" in log, proc.name
            assert "token expired" not in log
