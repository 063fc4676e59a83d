"""Training end to end with real processes: a coordinator and node agents on loopback.

* kill -9 of a stage node mid-job: the job re-plans the stage onto another node, rolls
  every stage back to the last consistent checkpoint and completes; the losses after the
  resume equal those of a run that went through the same checkpoint with nothing failing
  (training is deterministic: same model, data, seed and batches, fp32 on CPU).
* the runner (the `tessera train` process) killed with kill -9: `tessera train --resume`
  continues from the last checkpoint and finishes with the same losses.
* kill -9 of the coordinator mid-job, started again 2 s later: the job rides it out with no
  re-plan and the same losses.
* a job saved with --output-model is served by the swarm like any model, and its greedy
  output equals transformers' on the trained weights the coordinator stored.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint, transformers_greedy, write_safetensors
from support.datasets import counting_dataset
from support.swarms import three_stage_swarm
from support.waiting import wait_for

from client import billing
from client.api import AsyncClient, Client
from client.dataset_cache import CACHE_ENV
from client.datasets import TokenDataset
from client.jobs import JobEvent, TrainSpec
from client.local_swarm import LocalSwarm
from client.training_driver import TrainingDriverConfig
from coordinator.model_store.catalog import ModelCatalog

pytestmark = pytest.mark.slow

MODEL = "tiny-train-e2e"
NODES = ("alpha", "bravo", "charlie", "delta")
SPEC = TrainSpec(
    steps=8, batch_size=4, seq_len=16, lr=3e-3, micro_batches=2, checkpoint_every=2, seed=5
)
KILL_AFTER_STEP = 5  # the last consistent checkpoint is then step 4
_READY = re.compile(r"node (\w+) is ready with (\S+) layers \[(\d+), (\d+)\)")


def replicated(client: Client, model: str, replicas: int = 2) -> bool:
    info = {m.name: m for m in client.models()}.get(model)
    return bool(info and info.available and min(info.ready_replicas) >= replicas)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny", "llama", num_layers=6, **TINY_SHAPE, seed=3,
    )  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[TokenDataset, Path]:
    data = counting_dataset(64)
    path = tmp_path_factory.mktemp("data") / "counting.npy"
    np.save(path, data.tokens.reshape(64, 17))
    return data, path


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[LocalSwarm]:
    with three_stage_swarm(tmp_path_factory.mktemp("swarm"), checkpoint, MODEL, NODES) as s:
        yield s


def heal(swarm: LocalSwarm) -> None:
    alive = {p.name for p in swarm.processes if p.alive() and p.name in NODES}
    restarted = [swarm.start_node(name) for name in NODES if name not in alive]
    swarm.wait_registered(restarted)
    with Client(swarm.address) as client:
        wait_for(lambda: replicated(client, MODEL), "two ready replicas of every layer")


def run_job(
    swarm: LocalSwarm,
    data: TokenDataset,
    spec: TrainSpec = SPEC,
    hook=None,
    driver_config: TrainingDriverConfig | None = None,
):
    """Submit and run one job in this process; returns (job info, runner events)."""
    events: list[JobEvent] = []

    async def main():
        async with AsyncClient(swarm.address) as client:
            info, _ = await client.submit_training(MODEL, data, spec)
            final = await client.run_job(
                info.job_id, dataset=data, on_event=events.append,
                after_step=(lambda step: hook(client, info.job_id, step)) if hook else None,
                driver_config=driver_config,
            )  # fmt: skip
            return final

    return asyncio.run(main()), events


def step_losses(events: list[JobEvent]) -> list[tuple[int, float]]:
    """(step applied, loss) in the order the runner trained them."""
    return [(e.step - 1, e.loss) for e in events if e.kind == "step"]


@pytest.fixture(scope="module")
def reference(swarm: LocalSwarm, dataset) -> dict[int, float]:
    heal(swarm)
    info, events = run_job(swarm, dataset[0])
    assert info.step == SPEC.steps and info.replans == 0
    losses = dict(step_losses(events))
    assert losses[SPEC.steps - 1] < losses[0], "the job should learn the counting task"
    return losses


def ready_ranges(swarm: LocalSwarm, model: str) -> dict[str, tuple[int, int]]:
    """The latest READY range of every node, from the coordinator's log."""
    ranges: dict[str, tuple[int, int]] = {}
    for node_id, name, start, end in _READY.findall(swarm.coordinator.log_text()):
        if name == model:
            ranges[node_id] = (int(start), int(end))
    return ranges


async def stage_a_spare_can_take(swarm: LocalSwarm, client: AsyncClient, job_id: str) -> str:
    """The node of a stage that some node outside the job can take over (its READY shard
    covers the layers)."""
    job = await client.job(job_id)
    in_job = {s.node_id for s in job.stages}
    ranges = ready_ranges(swarm, MODEL)
    alive = {p.node_id for p in swarm.processes if p.alive() and p.node_id}
    spares = [n for n in ranges if n not in in_job and n in alive]
    stage = next(
        s for s in job.stages
        if any(ranges[n][0] <= s.layers.start and s.layers.end <= ranges[n][1] for n in spares)
    )  # fmt: skip
    return stage.node_id


def test_kill_9_of_a_stage_node_resumes_from_the_last_consistent_checkpoint(
    swarm, dataset, reference
) -> None:
    heal(swarm)
    killed: dict[str, str] = {}

    async def kill_a_stage(client: AsyncClient, job_id: str, step: int) -> None:
        if step != KILL_AFTER_STEP or killed:  # once: step 5 comes again after the resume
            return
        killed["node"] = await stage_a_spare_can_take(swarm, client, job_id)
        swarm.node(killed["node"]).kill9()

    info, events = run_job(swarm, dataset[0], hook=kill_a_stage)
    assert_one_replan_from_the_step_4_checkpoint(info, events, killed["node"], reference)


def assert_one_replan_from_the_step_4_checkpoint(info, events, failed: str, reference) -> None:
    assert info.step == SPEC.steps and info.state == 5  # JOB_STATE_DONE
    assert info.replans == 1 and failed not in {s.node_id for s in info.stages}
    replans = [e for e in events if e.kind == "replan"]
    assert len(replans) == 1 and replans[0].step == 4, "rolled back to the step-4 checkpoint"
    trained = step_losses(events)
    before = trained[:KILL_AFTER_STEP]
    after = trained[KILL_AFTER_STEP:]
    assert [s for s, _ in before] == list(range(KILL_AFTER_STEP))
    assert [s for s, _ in after] == list(range(4, SPEC.steps)), "steps 4.. redone once"
    for step, loss in trained:
        assert loss == pytest.approx(reference[step], rel=1e-5), step


def test_a_stage_node_that_freezes_mid_job_is_replanned_at_its_step_deadline(
    swarm, dataset, reference
) -> None:
    """SIGSTOP of a stage node: its process stops with every socket open, as a PC that went
    to sleep, so no call fails and no connection closes. Its calls had taken milliseconds,
    so the runner gives up on it after the deadline's floor (5 s here, 30 s by default)
    instead of the 300 s RPC timeout, and the job resumes elsewhere with the same losses."""
    heal(swarm)
    frozen: dict[str, Any] = {}

    async def freeze_a_stage(client: AsyncClient, job_id: str, step: int) -> None:
        if step != KILL_AFTER_STEP or frozen:
            return
        frozen["node"] = await stage_a_spare_can_take(swarm, client, job_id)
        frozen["at"] = time.monotonic()
        swarm.node(frozen["node"]).popen.send_signal(signal.SIGSTOP)

    config = TrainingDriverConfig(step_deadline_floor_s=5.0)
    try:
        info, events = run_job(swarm, dataset[0], hook=freeze_a_stage, driver_config=config)
        finished = time.monotonic()
    finally:
        if frozen:
            swarm.node(frozen["node"]).kill9()  # heal() starts it again for the next test
    assert_one_replan_from_the_step_4_checkpoint(info, events, frozen["node"], reference)
    replan = next(e for e in events if e.kind == "replan")
    waited = re.search(r"DEADLINE_EXCEEDED: no answer within ([\d.]+) s", replan.detail)
    assert waited and 5.0 <= float(waited.group(1)) < 30.0, replan.detail
    # The rest of the job (restore, 4 steps) takes seconds here; 300 s would be the cold wait.
    assert finished - frozen["at"] < 120.0


JOB_ID = re.compile(r"tessera train --resume (\S+) continues it")


def lines_until(stream: IO[bytes], marker: str, timeout_s: float = 120.0) -> str:
    """What ``stream`` said up to its first line holding ``marker``; a reader thread, so
    that a process that falls silent fails the test instead of hanging it."""
    lines: queue.Queue[bytes] = queue.Queue()

    def read() -> None:
        for line in iter(stream.readline, b""):
            lines.put(line)
        lines.put(b"")  # the stream ended

    threading.Thread(target=read, daemon=True).start()
    said = ""
    deadline = time.monotonic() + timeout_s
    while marker not in said:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {marker!r} within {timeout_s:.0f} s; said:\n{said}") from None
        if not line:
            raise AssertionError(f"the stream ended before {marker!r}; said:\n{said}")
        said += line.decode()
    return said


def test_a_killed_runner_is_resumed_with_tessera_train_resume(
    swarm, dataset, reference, tmp_path, monkeypatch
) -> None:
    heal(swarm)
    # Both runs use one client key, which the first creates: it owns the job.
    monkeypatch.setenv(billing.KEY_ENV, str(tmp_path / "client.key"))
    # The resumed runner has no file: it downloads the dataset, and keeps it here.
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    cli = [sys.executable, "-m", "client.cli", "train", "--coordinator", swarm.address]
    runner = subprocess.Popen(
        [*cli, "--model", MODEL, "--data", str(dataset[1]), "--steps", str(SPEC.steps),
         "--batch-size", str(SPEC.batch_size), "--seq-len", str(SPEC.seq_len),
         "--lr", str(SPEC.lr), "--micro-batches", str(SPEC.micro_batches),
         "--checkpoint-every", str(SPEC.checkpoint_every), "--seed", str(SPEC.seed), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        with Client(swarm.address) as client:
            # kill -9 of the driver mid-job, as soon as it says the step-4 checkpoint is
            # taken: polling the coordinator instead missed the whole job on a fast box.
            said = lines_until(runner.stderr, "checkpoint at step 4")
            runner.kill()
            runner.wait(10)
            job_id = JOB_ID.search(said).group(1)
            job = client.job(job_id)
            assert job.state == 2 and job.checkpoint_step >= 4, (job.state, said)  # RUNNING
            resumed = subprocess.run(
                [*cli, "--resume", job_id, "--json"], capture_output=True, text=True, timeout=300
            )
            assert resumed.returncode == 0 and resumed.stdout, resumed.stderr[-3000:]
            final = json.loads(resumed.stdout)
            assert final["state"] == "done" and int(final["step"]) == SPEC.steps
            assert int(final["checkpoint_step"]) == SPEC.steps
            losses = {p.step: p.loss for p in client.job(job_id).losses}
            kept = tmp_path / "cache" / "datasets" / f"{job.dataset_id}.npy"
            assert np.array_equal(np.load(kept), np.load(dataset[1]))
    finally:
        if runner.poll() is None:
            runner.kill()
    assert sorted(losses) == list(range(SPEC.steps))
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step


def test_a_trained_model_is_served_through_generate(swarm, dataset, checkpoint) -> None:
    heal(swarm)
    name = "tiny-train-e2e-ft"
    spec = TrainSpec(steps=4, batch_size=4, seq_len=16, lr=3e-3, checkpoint_every=0,
                     output_model=name, seed=1)  # fmt: skip
    info, _ = run_job(swarm, dataset[0], spec)
    assert info.output_model == name and info.state == 5
    prompt = [10, 11, 12, 13, 14]
    with Client(swarm.address) as client:
        wait_for(lambda: replicated(client, name, 1), f"model {name} to be served")
        served = client.generate_all(name, token_ids=prompt, max_new_tokens=6, stop_at_eos=False)

    # The reference: transformers on the weights the coordinator stored for the new model.
    store_dir = swarm.coordinator_dir
    trained = Path(store_dir) / "trained"
    trained.mkdir(exist_ok=True)
    catalog = ModelCatalog(sqlite3.connect(store_dir / "coordinator.db"))
    tensors = {}
    for t in catalog.tensors(name):
        raw = (store_dir / "blobs" / t.sha256[:2] / t.sha256[2:]).read_bytes()
        tensors[t.name] = (t.dtype, np.frombuffer(raw, dtype="<f4").reshape(t.shape))
    write_safetensors(trained / "model.safetensors", tensors)
    (trained / "config.json").write_text((checkpoint / "config.json").read_text())
    assert served.token_ids == transformers_greedy(trained, [prompt], 6)[0]
    base = load_base(checkpoint)
    assert any(not np.array_equal(tensors[n][1], base[n]) for n in base), "weights were trained"


def load_base(checkpoint: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def test_a_job_rides_out_a_coordinator_restart(swarm, dataset, reference) -> None:
    # kill -9 of the coordinator after step 3, started again on its database 2 s later.
    # The stages train without it; the runner's step report waits for it, and the nodes
    # (which register again by themselves) checkpoint into it as before: no stage is
    # blamed, nothing is re-planned or rolled back, and every loss is the reference's.
    heal(swarm)
    address = swarm.address
    restarted = threading.Event()

    def restart() -> None:
        swarm.coordinator.kill9()
        time.sleep(2.0)
        swarm.start_coordinator(listen=address)
        restarted.set()

    def blip(client: AsyncClient, job_id: str, step: int) -> None:
        if step == 3:
            threading.Thread(target=restart, daemon=True).start()

    info, events = run_job(swarm, dataset[0], hook=blip)
    assert restarted.wait(60), "the coordinator did not come back"
    assert info.state == 5 and info.step == SPEC.steps  # JOB_STATE_DONE
    assert info.replans == 0 and not [e for e in events if e.kind in ("replan", "resume")]
    trained = step_losses(events)
    assert [s for s, _ in trained] == list(range(SPEC.steps)), "every step once, in order"
    for step, loss in trained:
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    with Client(address) as client:
        job = client.job(info.job_id)
    assert [p.step for p in job.losses] == list(range(SPEC.steps))
    assert job.checkpoint_step == SPEC.steps
