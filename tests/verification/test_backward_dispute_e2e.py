"""A backward dispute end to end: a real coordinator, four real node agents of four
operators on loopback, a training job of two stages through the JobRunner.

Every node is the turncoat agent of tests/ledger, with `corrupt_backward=1.0` that acts only
while its trigger file exists. After the job's first step the test turns whichever node
holds the second stage: from then on the input gradient it sends back to the first stage
is wrong, while its forwards and its loss stay honest. So only the backward pass can
show it. Its lockstep checker computes the honest gradient; the coordinator replays the
logged calls on a third operator's node, which sides with the checker; the cheater is
convicted and banned, the stage moves, and the job's losses equal those of an honest run
(the wrong gradient had only reached the first stage's update, which is rolled back).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.datasets import counting_dataset
from support.market import (
    MODEL,
    make_market_checkpoint,
    running_market,
    serves,
    turncoats,
    wait_for,
)

from client.api import AsyncClient, Client
from client.datasets import TokenDataset
from client.jobs import JobEvent, TrainSpec
from client.local_swarm import LocalSwarm
from protos.tessera.v1 import jobs_pb2, node_pb2

pytestmark = pytest.mark.slow

NODES = {"alpha": 0, "bravo": 0, "charlie": 0, "delta": 0}  # a free swarm
SPEC = TrainSpec(
    steps=4, batch_size=4, seq_len=16, lr=3e-3, micro_batches=2, checkpoint_every=1, seed=5
)


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSwarm, dict]]:
    work = tmp_path_factory.mktemp("backward")
    scripts, env, triggers = turncoats(work, NODES, "corrupt_backward=1.0,seed=5")
    with running_market(
        work / "swarm",
        make_market_checkpoint(work / "ckpt"),
        scripts,
        # Every node holds both stages: each stage has a checker and an arbiter of other
        # operators. A warm-up no node reaches: every step is checked in lockstep.
        layout=("--min-stages", "2", "--replicas", "4"),
        coordinator_args=("--canary-interval", "0", "--verify-warmup", "100000"),
        node_env=env,
        prices=NODES,
    ) as swarm:
        with Client(swarm.address) as client:
            ids = [n.node_id for n in client.nodes()]
            wait_for(lambda: all(serves(client, i) for i in ids), "every node to serve")
        yield swarm, triggers


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return counting_dataset()


def run_job(
    swarm: LocalSwarm, data: TokenDataset, turn: dict[str, Path] | None = None
) -> tuple[jobs_pb2.JobInfo, list[JobEvent], list[jobs_pb2.StagePlan]]:
    """The job to its end; with ``turn`` (triggers by node name), the node of its second
    stage turns after step 1. Returns its info, its events and the stages it started on."""
    events: list[JobEvent] = []
    started: list[jobs_pb2.StagePlan] = []

    async def main() -> jobs_pb2.JobInfo:
        async with AsyncClient(swarm.address) as client:
            info, _ = await client.submit_training(MODEL, data, SPEC)

            async def after_step(step: int) -> None:
                if step != 1:
                    return
                started.extend((await client.job(info.job_id)).stages)
                if turn is not None:
                    turn[swarm.node(started[1].node_id).name].touch()

            return await client.run_job(
                info.job_id, dataset=data, on_event=events.append, after_step=after_step
            )

    return asyncio.run(main()), events, started


def final_losses(events: list[JobEvent]) -> dict[int, float]:
    """Each step's loss as finally trained (a rolled-back step's redo overwrites it)."""
    return {e.step - 1: e.loss for e in events if e.kind == "step"}


def story(swarm: LocalSwarm) -> str:
    words = ("job ", "mismatch", "arbiter", "FRAUD", "dispute", "refused", "checks")
    lines = swarm.coordinator.log_text().splitlines()
    return "\n".join(line for line in lines if any(w in line for w in words))[-6000:]


def test_a_wrong_input_gradient_is_arbitrated_and_the_job_stays_honest(market, dataset) -> None:
    swarm, triggers = market
    honest, honest_events, honest_stages = run_job(swarm, dataset)
    assert honest.step == SPEC.steps and honest.replans == 0 and len(honest_stages) == 2
    assert "FRAUD PROVEN" not in swarm.coordinator.log_text()

    info, events, stages = run_job(swarm, dataset, turn=triggers)
    cheater = stages[1].node_id
    with Client(swarm.address) as client:
        states = {n.node_id: n.state for n in client.nodes(include_offline=True)}
    assert states[cheater] == node_pb2.NODE_STATE_BANNED, story(swarm)
    assert [s for s, state in states.items() if state == node_pb2.NODE_STATE_BANNED] == [cheater]
    replans = [e for e in events if e.kind == "replan"]
    assert replans and cheater in replans[0].detail, [e.detail for e in replans]
    assert info.step == SPEC.steps and cheater not in {s.node_id for s in info.stages}
    log = swarm.coordinator.log_text()
    assert f"FRAUD PROVEN: node {cheater}" in log
    # The steps redone after the rollback repeat replies reported before it (the same
    # signatures): the runner leaves those out, and the rest of its reports are taken.
    assert "refused training checks" not in log, story(swarm)
    # The proof is of the backward pass: its forwards were honest.
    with sqlite3.connect(swarm.coordinator_dir / "coordinator.db") as db:
        details = [
            row[0]
            for row in db.execute(
                "SELECT detail FROM verification_evidence WHERE accused_node_id = ?", [cheater]
            )
        ]
    assert details and all("backward" in d for d in details), details
    assert final_losses(events) == pytest.approx(final_losses(honest_events), rel=1e-6)
