"""Training verification end to end: a real coordinator, real node-agent processes, real
SQLite, jobs through the JobRunner (issue 6).

Three honest nodes of three operators hold the whole model; every job's stage gets a
checker of another operator, and new nodes are checked in lockstep on every interval. A
cheater joins with TESSERA_FAILPOINTS that also inflate its benchmark, so the job planner
picks it as the stage node. Whether it corrupts its forwards or skips its optimizer
updates, its lockstep checker disagrees, the coordinator replays the logged calls from
the checkpoint on the third operator's node, convicts and bans the cheater, the stage
moves, and the job's losses equal those of an honest run.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
from support.checkpoints import make_checkpoint
from support.datasets import counting_dataset
from support.waiting import wait_for

from client.api import AsyncClient, Client
from client.datasets import TokenDataset
from client.jobs import JobEvent, TrainSpec
from client.local_swarm import LocalProcess, LocalSwarm
from node_agent.failpoints import ENV_VAR
from protos.tessera.v1 import node_pb2

pytestmark = pytest.mark.slow

MODEL = "tiny-train-verify"
HONEST = {"honest-a": "op-a", "honest-b": "op-b", "honest-c": "op-c"}
SPEC = TrainSpec(
    steps=4, batch_size=4, seq_len=16, lr=3e-3, micro_batches=2, checkpoint_every=2, seed=5
)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    checkpoint = make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny", "llama", num_layers=2, hidden_size=32,
        intermediate_size=64, num_heads=4, num_kv_heads=2, vocab_size=96, seed=3,
    )  # fmt: skip
    args = [
        "--min-stages", "1", "--replicas", "4", "--heartbeat-interval", "1",
        "--verify-warmup", "100000", "--canary-interval", "0",
    ]  # fmt: skip
    with LocalSwarm(tmp_path_factory.mktemp("swarm"), coordinator_args=args) as s:
        s.start_coordinator()
        nodes = [s.start_node(name, ["--account", account]) for name, account in HONEST.items()]
        s.wait_registered(nodes)
        s.add_model(checkpoint, MODEL)
        with Client(s.address) as client:
            wait_for(lambda: ready_replicas(client) >= 3, "three ready replicas of the model")
        yield s


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return counting_dataset()


def ready_replicas(client: Client) -> int:
    info = {m.name: m for m in client.models()}.get(MODEL)
    return min(info.ready_replicas) if info and info.available else 0


def state_of(client: Client, node_id: str) -> int:
    for info in client.nodes(include_offline=True):
        if info.node_id == node_id:
            return info.state
    return node_pb2.NODE_STATE_UNSPECIFIED


def run_job(swarm: LocalSwarm, data: TokenDataset) -> tuple[object, list[JobEvent]]:
    events: list[JobEvent] = []

    async def main():
        async with AsyncClient(swarm.address) as client:
            info, _ = await client.submit_training(MODEL, data, SPEC)
            return await client.run_job(info.job_id, dataset=data, on_event=events.append)

    return asyncio.run(main()), events


def final_losses(events: list[JobEvent]) -> dict[int, float]:
    """Each step's loss as finally trained (a rolled-back step's redo overwrites it)."""
    return {e.step - 1: e.loss for e in events if e.kind == "step"}


@pytest.fixture(scope="module")
def reference(swarm: LocalSwarm, dataset: TokenDataset) -> dict[int, float]:
    info, events = run_job(swarm, dataset)
    assert info.step == SPEC.steps and info.replans == 0, "an honest checked job"
    assert "FRAUD PROVEN" not in swarm.coordinator.log_text()
    assert "redundant check failed" not in swarm.coordinator.log_text()
    return final_losses(events)


def story(swarm: LocalSwarm) -> str:
    """The coordinator's lines about jobs and verification: why a test failed."""
    words = ("job ", "mismatch", "arbiter", "FRAUD", "dispute", "refused")
    lines = swarm.coordinator.log_text().splitlines()
    return "\n".join(line for line in lines if any(w in line for w in words))[-6000:]


def start_cheater(swarm: LocalSwarm, name: str, spec: str) -> LocalProcess:
    os.environ[ENV_VAR] = f"{spec},inflate_benchmark=50"  # the swarm copies the environment
    try:
        proc = swarm.start_node(name, ["--account", f"op-{name}"])
    finally:
        os.environ.pop(ENV_VAR, None)
    swarm.wait_registered([proc])
    return proc


def verified(client: Client) -> int:
    return sum(n.trust.verified for n in client.nodes(include_offline=True))


def test_honest_checked_jobs_agree_and_earn_trust(swarm, dataset, reference) -> None:
    with Client(swarm.address) as client:
        before = verified(client)
        info, events = run_job(swarm, dataset)
        # One agreement per checked step: the stage node and its checker both earn it.
        assert verified(client) - before == 2 * SPEC.steps
    assert info.replans == 0
    assert final_losses(events) == pytest.approx(reference, rel=1e-6)
    log = swarm.coordinator.log_text()
    assert "FRAUD PROVEN" not in log and "mismatch" not in log


@pytest.mark.parametrize("cheat", ["corrupt=1.0", "skip_step=1.0"])
def test_a_cheating_stage_node_is_arbitrated_banned_and_the_losses_stay_honest(
    swarm, dataset, reference, cheat: str
) -> None:
    name = "cheat-" + cheat.split("=")[0].replace("_", "-")
    cheater = start_cheater(swarm, name, cheat)
    with Client(swarm.address) as client:
        wait_for(lambda: ready_replicas(client) >= 4, "the cheater to hold the model")
        info, events = run_job(swarm, dataset)
        assert state_of(client, cheater.node_id) == node_pb2.NODE_STATE_BANNED, story(swarm)
    replans = [e for e in events if e.kind == "replan"]
    assert replans and cheater.node_id in replans[0].detail, [e.detail for e in replans]
    assert "redundant check failed" in replans[0].detail
    assert info.step == SPEC.steps and cheater.node_id not in {s.node_id for s in info.stages}
    log = swarm.coordinator.log_text()
    assert f"FRAUD PROVEN: node {cheater.node_id}" in log
    assert final_losses(events) == pytest.approx(reference, rel=1e-6)


def test_a_cheating_checker_is_banned_and_the_job_goes_on(swarm, dataset, reference) -> None:
    """Runs last: it adds a fast honest node. That node's (claimed) speed makes it the
    stage node, the cheater is the next cheapest, so its checker; the arbiter sides with
    the stage node, the checker is banned and dropped, and nothing is re-planned."""
    os.environ[ENV_VAR] = "inflate_benchmark=500"  # an honest node that claims more speed
    try:
        fast = swarm.start_node("honest-fast", ["--account", "op-fast"])
    finally:
        os.environ.pop(ENV_VAR, None)
    swarm.wait_registered([fast])
    cheater = start_cheater(swarm, "cheat-checker", "corrupt=1.0")
    with Client(swarm.address) as client:
        wait_for(lambda: ready_replicas(client) >= 4, "the new nodes to hold the model")
        wait_for(
            lambda: {fast.node_id, cheater.node_id} <= ready_nodes(client),
            "both new nodes to serve the model",
        )
        info, events = run_job(swarm, dataset)
        assert state_of(client, cheater.node_id) == node_pb2.NODE_STATE_BANNED, story(swarm)
        assert state_of(client, fast.node_id) == node_pb2.NODE_STATE_ONLINE
    assert info.replans == 0 and [s.node_id for s in info.stages] == [fast.node_id]
    assert f"FRAUD PROVEN: node {cheater.node_id}" in swarm.coordinator.log_text()
    assert final_losses(events) == pytest.approx(reference, rel=1e-6)


def ready_nodes(client: Client) -> set[str]:
    return {
        n.node_id for n in client.nodes()
        if any(s.model == MODEL and s.state == node_pb2.SHARD_STATE_READY for s in n.shards)
    }  # fmt: skip
