"""Stage nodes checkpoint into the real coordinator's TrainingStore and restore from it.

A real in-process coordinator (tests/jobs/jobs_harness.py: registry, placement, jobs,
TrainingStore) places a 3-stage training job on registered nodes. Each of those nodes
runs a real TrainingStage data plane here, with the identity (key, attach ticket) it
registered with, so its uploads and downloads are authenticated like a node agent's. The
driver trains through them with the session the coordinator issued, reports its steps,
saves a checkpoint that the coordinator records as consistent, and a re-opened session
restores every stage from it: the losses after the restore repeat those before.
"""

from __future__ import annotations

import numpy as np
import pytest
from data_plane.stage_harness import node_context
from jobs.jobs_harness import (  # noqa: F401 - start_jobs and tiny_model are fixtures
    MODEL,
    NUM_LAYERS,
    JobsCoordinator,
    hyper,
    start_jobs,
    tiny_model,
)

from client.training_driver import StepResult, TrainingDriver, TrainingHop
from node_agent.data_plane import start_server
from node_agent.shard_manager import DirectorySource, ShardManager
from node_agent.stage_server import StageServicer
from node_agent.training_server import TrainingStageServicer
from protos.tessera.v1 import coordinator_pb2, jobs_pb2, node_pb2

BATCH, SEQ = 4, 8


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    tokens = rng.integers(3, 64, size=(BATCH, SEQ)).astype(np.int64)
    labels = np.roll(tokens, -1, axis=1)
    labels[:, -1] = -100
    return tokens, labels


async def report(jc: JobsCoordinator, session: jobs_pb2.TrainingSession, r: StepResult) -> None:
    await jc.stub.ReportStep(
        jobs_pb2.ReportStepRequest(
            job_id=session.job_id,
            capability=session.capability,
            step=r.step,
            loss=r.loss,
            grad_norm=r.grad_norm,
            tokens=r.tokens,
            tokens_per_s=r.tokens / r.wall_s,
            stage_ms=r.stage_ms,
            wall_s=r.wall_s,
        )
    )


async def test_checkpoints_go_to_the_coordinator_and_restore_from_it(
    start_jobs,  # noqa: F811 - the fixture imported above
    tiny_model,  # noqa: F811
    tmp_path,
) -> None:
    jc = await start_jobs(nodes=3, replicas=1)
    await jc.ready(replicas=1)
    dataset = await jc.upload(np.arange(2000) % 60 + 3)
    job = await jc.submit(dataset.id, steps=10, batch_size=BATCH, seq_len=SEQ, checkpoint_every=2)
    session = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
    )
    assert len(session.hops) >= 2

    servers, managers, hops = [], [], []
    try:
        for index, hop in enumerate(session.hops):
            fake = jc.node(hop.node_id)
            ctx = node_context(tmp_path / f"stage{index}", jc.coordinator.ctx.public_key)
            ctx.private_key, ctx.node_id, ctx.attach_ticket = fake.key, fake.node_id, fake.ticket
            ctx.coordinator_address = jc.coordinator.address
            manager = ShardManager(DirectorySource(tiny_model))
            ctx.shard_handler = manager
            managers.append(manager)
            statuses: list[node_pb2.ShardStatus] = []
            await manager.assign(
                coordinator_pb2.AssignShard(
                    model=MODEL, layers=hop.layers, dtype="float32", num_layers=NUM_LAYERS
                ),
                statuses.append,
            )
            assert statuses[-1].state == node_pb2.SHARD_STATE_READY
            server, port = await start_server(
                ctx, "127.0.0.1:0", StageServicer(ctx, manager), TrainingStageServicer(ctx, manager)
            )
            servers.append(server)
            hops.append(
                TrainingHop(hop.node_id, f"127.0.0.1:{port}", hop.layers.start, hop.layers.end)
            )

        h = hyper()
        driver = TrainingDriver(
            job_id=job.job_id, model=MODEL, hops=hops, capability=session.capability, hyper=h
        )
        try:
            assert await driver.open() == 0
            for step in range(2):
                await report(jc, session, await driver.train_step(step, *batch(step)))
            digests = await driver.save_checkpoint(2)
            before = [(await driver.train_step(s, *batch(s))).loss for s in (2, 3)]

            # A new session (the driver went away): the coordinator names the checkpoint.
            session = await jc.stub.OpenTrainingSession(
                jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
            )
            assert session.restore_step == 2
            recorded = {(p.layers.start, p.layers.end): p.sha256 for p in session.restore}
            assert recorded == digests
            driver.replace_hop(0, hops[0], session.capability)
            assert await driver.open(restore_step=2, restore_sha256=recorded) == 2
            after = [(await driver.train_step(s, *batch(s))).loss for s in (2, 3)]
        finally:
            await driver.close()
    finally:
        for server in servers:
            await server.stop(0)
        for manager in managers:
            manager.close()
    assert after == pytest.approx(before, rel=1e-6)
    info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=job.job_id))
    assert info.checkpoint_step == 2
