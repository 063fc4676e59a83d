"""Verification end to end: a real coordinator and real node agents on loopback.

Misbehaviour comes from TESSERA_FAILPOINTS in a node agent's environment, exactly as an
operator (or an attacker's modified agent) would produce it; nothing is mocked.

- A node corrupting 5% of its outputs is detected and banned within a number of its calls
  bounded by the formula 1 - (1 - p*f)^n, and every generation of the run still equals
  the honest output (transformers' reference).
- Two nodes of one operator never check each other.
- A lazy node (zeros) is caught by canaries with no client traffic at all.
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint, transformers_greedy
from support.waiting import wait_for

from client.api import Client
from client.local_swarm import LocalProcess, LocalSwarm
from node_agent.failpoints import ENV_VAR
from protos.tessera.v1 import node_pb2

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPTS = ([1, 5, 9, 23, 42, 7, 11], [3, 14, 15, 92, 65], [2, 71, 82, 81, 8, 28])
NEW_TOKENS = 12
CORRUPTION = 0.05
# Every output of a node is checked while it is new (warmup beyond the test's length):
# p = 1, so a node corrupting f = 5% of its outputs escapes n calls with (1 - f)^n.
MISS_PROBABILITY = 1e-4
BOUND = math.ceil(math.log(MISS_PROBABILITY) / math.log(1 - 1.0 * CORRUPTION))  # 180


# honest-a2 has the same operator as honest-a1: the two must never check each other.
ACCOUNTS = {"honest-a1": "op-a", "honest-a2": "op-a", "honest-b": "op-b", "cheater": "op-c"}
FAILPOINTS = {"cheater": f"corrupt={CORRUPTION},seed=4"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny",
        "llama",
        num_layers=4,
        **TINY_SHAPE,
        seed=11,
    )


@pytest.fixture(scope="module")
def references(checkpoint: Path) -> dict[tuple[int, ...], list[int]]:
    generated = transformers_greedy(checkpoint, PROMPTS, NEW_TOKENS)
    return {tuple(prompt): ids for prompt, ids in zip(PROMPTS, generated, strict=True)}


def start_node(swarm: LocalSwarm, name: str, account: str, failpoints: str = "") -> LocalProcess:
    # The swarm copies this process's environment into each child it starts.
    previous = os.environ.pop(ENV_VAR, None)
    if failpoints:
        os.environ[ENV_VAR] = failpoints
    try:
        return swarm.start_node(name, ["--account", account])
    finally:
        os.environ.pop(ENV_VAR, None)
        if previous is not None:
            os.environ[ENV_VAR] = previous


def state_of(client: Client, node_id: str) -> int:
    for info in client.nodes(include_offline=True):
        if info.node_id == node_id:
            return info.state
    return node_pb2.NODE_STATE_UNSPECIFIED


def ready_everywhere(client: Client, replicas: int) -> bool:
    info = {m.name: m for m in client.models()}.get(MODEL)
    return bool(info and info.available and min(info.ready_replicas) >= replicas)


@pytest.fixture(scope="module")
def cheating_swarm(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path
) -> Iterator[tuple[LocalSwarm, dict[str, LocalProcess]]]:
    work = tmp_path_factory.mktemp("swarm")
    args = [
        "--min-stages", "1", "--replicas", "4", "--heartbeat-interval", "1",
        "--verify-warmup", "100000", "--canary-interval", "0",
    ]  # fmt: skip
    with LocalSwarm(work, coordinator_args=args) as swarm:
        swarm.start_coordinator()
        nodes = {
            name: start_node(swarm, name, account, FAILPOINTS.get(name, ""))
            for name, account in ACCOUNTS.items()
        }
        swarm.wait_registered(list(nodes.values()))
        swarm.add_model(checkpoint, MODEL)
        yield swarm, nodes


def test_a_5_percent_corrupter_is_banned_within_the_bound_and_outputs_stay_honest(
    cheating_swarm, references
) -> None:
    swarm, nodes = cheating_swarm
    cheater = nodes["cheater"].node_id
    accounts = {p.node_id: ACCOUNTS[name] for name, p in nodes.items()}
    assert "FAILPOINTS ACTIVE" in nodes["cheater"].log_text()
    with Client(swarm.address, timeout_s=60) as client:
        wait_for(lambda: ready_everywhere(client, 4), "every node to serve the whole model", 90)
        cheater_calls = 0
        generations = 0
        pairs: list[tuple[str, str]] = []
        while state_of(client, cheater) != node_pb2.NODE_STATE_BANNED:
            assert cheater_calls <= BOUND, (
                f"the cheater served {cheater_calls} calls without being banned; the formula "
                f"bounds it by {BOUND} at miss probability {MISS_PROBABILITY}"
            )
            prompt = PROMPTS[generations % len(PROMPTS)]
            result = client.generate_all(
                MODEL, token_ids=prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False
            )
            generations += 1
            assert result.token_ids == references[tuple(prompt)], (
                f"generation {generations} differs from the honest output"
            )
            stats = result.verification
            assert stats is not None
            pairs += stats.pairs
            cheater_calls += stats.calls.get(cheater, 0)
            cheater_calls += sum(1 for _, checker in stats.pairs if checker == cheater)
        trust = {n.node_id: n.trust for n in client.nodes(include_offline=True)}
    # The client can read the session's risk figures the coordinator computed.
    risk = result.verification.risk
    assert risk is not None and risk.calls >= NEW_TOKENS and 0 < risk.checked <= risk.calls
    p = risk.checked / risk.calls
    assert risk.detection_probability == pytest.approx(1 - (1 - p * CORRUPTION) ** risk.calls)
    assert trust[cheater].failures >= 1
    # Honest nodes were never blamed, and one operator's nodes never checked each other.
    for name in ("honest-a1", "honest-a2", "honest-b"):
        assert trust[nodes[name].node_id].failures == 0, name
        assert state_of_log(nodes[name]) != "banned"
    assert pairs, "no output was ever checked"
    assert all(accounts[a] != accounts[b] for a, b in pairs), pairs
    log = swarm.coordinator.log_text()
    assert f"FRAUD PROVEN: node {cheater}" in log
    assert "P(detect a node corrupting 5% of outputs)" in log


def state_of_log(proc: LocalProcess) -> str:
    return "banned" if "node banned" in proc.log_text() else "ok"


# An echoing node answers its input: that needs a middle stage, so the model is split.
@pytest.mark.parametrize(("mode", "stages"), [("zeros", 1), ("echo", 2)])
def test_a_lazy_node_is_caught_by_canaries_without_client_traffic(
    tmp_path: Path, checkpoint: Path, mode: str, stages: int
) -> None:
    args = [
        "--min-stages", str(stages), "--replicas", "3", "--heartbeat-interval", "1",
        "--canary-interval", "1",
    ]  # fmt: skip
    with LocalSwarm(tmp_path, coordinator_args=args) as swarm:
        swarm.start_coordinator()
        honest = [start_node(swarm, f"h{i}", f"op-{i}") for i in range(2)]
        lazy = start_node(swarm, "lazy", "op-lazy", mode)
        swarm.wait_registered([*honest, lazy])
        swarm.add_model(checkpoint, MODEL)
        with Client(swarm.address) as client:
            wait_for(
                lambda: state_of(client, lazy.node_id) == node_pb2.NODE_STATE_BANNED,
                "the canaries to get the lazy node banned",
                120,
            )
            trust = {n.node_id: n.trust for n in client.nodes(include_offline=True)}
        assert trust[lazy.node_id].canary_failed >= 1
        for node in honest:
            assert trust[node.node_id].canary_failed == 0
            assert trust[node.node_id].canary_passed >= 1
            assert state_of_log(node) == "ok"
        log = swarm.coordinator.log_text()
        assert f"FRAUD PROVEN: node {lazy.node_id}" in log and "canary" in log
        # The honest agreements were recorded as calibration data for their dtype pair.
        db = sqlite3.connect(swarm.coordinator_dir / "coordinator.db")
        rows = db.execute(
            "SELECT pair, comparisons, max_error, tolerance FROM canary_calibration"
        ).fetchall()
        db.close()
        assert rows and all(pair == "cpu/float32~cpu/float32" for pair, *_ in rows), rows
        assert all(n >= 1 and error <= tolerance / 5 for _, n, error, tolerance in rows), rows
        # `tessera nodes` shows trust and state.
        listing = subprocess.run(
            [sys.executable, "-m", "client.cli", "nodes", "--all", "--coordinator", swarm.address],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert "TRUST" in listing.splitlines()[0]
        [lazy_row, why] = [line for line in listing.splitlines() if lazy.node_id in line]
        assert why.startswith(f"{lazy.node_id} is banned: proven wrong output (canary)"), why
        failed = re.search(r"(\d+) failed", lazy_row)
        assert "banned" in lazy_row and failed and int(failed.group(1)) >= 1, lazy_row
