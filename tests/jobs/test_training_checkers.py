"""The coordinator grants each training stage an independent checker (issue 6).

A real in-process coordinator with fake stage nodes of several operator accounts: every
stage of a job session gets, where the swarm has one, a ready holder of its layers outside
the pipeline and of another operator, granted in the capability with its key and check
probability; re-plans keep the checkers consistent with the new pipeline; a stage failure
that names suspect checkpoints rolls the job back to an older consistent one.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from jobs.jobs_harness import JobsCoordinator
from jobs.test_checkpoints import _advance, _chunks, upload

from protos import identity
from protos.tessera.v1 import client_api_pb2, jobs_pb2, training_pb2


async def coordinator_with(start_jobs, accounts: list[str]) -> JobsCoordinator:
    jc = await start_jobs(nodes=len(accounts), accounts=accounts)
    await jc.ready(replicas=2)
    await jc.all_ready()
    return jc


async def open_job(jc: JobsCoordinator, **overrides) -> jobs_pb2.TrainingSession:
    dataset = await jc.upload(np.arange(400, dtype=np.int32) % 60)
    job = await jc.submit(dataset.id, **overrides)
    return await jc.stub.OpenTrainingSession(jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id))


async def report_failure(
    jc: JobsCoordinator, request: jobs_pb2.StageFailureRequest
) -> jobs_pb2.TrainingSession:
    """ReportStageFailure, retried while a spare loads the layers (as the job runner does;
    the harness's nodes load at once)."""
    for _ in range(50):
        try:
            return await jc.stub.ReportStageFailure(request)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("no node took over the stage in 5 s")


def claims_of(
    jc: JobsCoordinator, session: jobs_pb2.TrainingSession
) -> client_api_pb2.CapabilityClaims:
    claims = identity.open_capability(jc.coordinator.ctx.public_key, session.capability)
    assert claims is not None
    return claims


def assert_independent(jc: JobsCoordinator, session: jobs_pb2.TrainingSession) -> None:
    pipeline = {h.node_id for h in session.hops}
    granted = {g.node_id: g for g in claims_of(jc, session).grants}
    by_layers = {(h.layers.start, h.layers.end): h for h in session.hops}
    checkers = [c.node_id for c in session.checkers]
    assert len(set(checkers)) == len(checkers), "one stage per checker node"
    for checker in session.checkers:
        stage = by_layers[(checker.layers.start, checker.layers.end)]
        assert checker.node_id not in pipeline
        assert checker.account and checker.account != stage.account
        assert jc.node(checker.node_id).shards[jc.jobs.manager.repo.job(session.job_id).model]
        grant = granted[checker.node_id]
        assert grant.public_key == jc.node(checker.node_id).public_key
        assert grant.layers == checker.layers and grant.check_probability == 1.0


async def test_each_stage_gets_a_granted_checker_of_another_operator(start_jobs) -> None:
    jc = await coordinator_with(start_jobs, [f"op{i}" for i in range(6)])
    session = await open_job(jc)
    # The planner chooses the layout; every stage of it gets a checker.
    assert session.hops and len(session.checkers) == len(session.hops)
    assert_independent(jc, session)
    # The checkers' shadow states hold memory like the stages' own.
    reserved = jc.jobs.manager._reserved
    assert {c.node_id for c in session.checkers} <= {n for j, n in reserved if j == session.job_id}


async def test_no_checker_of_the_stage_nodes_own_operator(start_jobs) -> None:
    """One operator runs every node: nobody may check anybody, so no checkers."""
    jc = await coordinator_with(start_jobs, ["alice"] * 6)
    session = await open_job(jc)
    assert session.hops and list(session.checkers) == []
    assert len(claims_of(jc, session).grants) == len(session.hops)


async def test_a_replan_keeps_checkers_outside_the_new_pipeline(start_jobs) -> None:
    jc = await coordinator_with(start_jobs, [f"op{i}" for i in range(6)])
    session = await open_job(jc)
    failed = session.hops[-1]
    request = jobs_pb2.StageFailureRequest(
        job_id=session.job_id, capability=session.capability, stage=len(session.hops) - 1,
        node_id=failed.node_id, cause="test",
    )  # fmt: skip
    replanned = await report_failure(jc, request)
    assert replanned.hops[-1].node_id != failed.node_id
    assert failed.node_id not in {c.node_id for c in replanned.checkers}
    assert_independent(jc, replanned)


async def test_suspect_checkpoints_roll_the_job_back(start_jobs) -> None:
    """A stage failure with restore_at_most (a lockstep shadow disproved the node's
    uploads since then) restores the newest consistent checkpoint at or before it and
    forgets the newer ones; a plain failure keeps the newest."""
    jc = await coordinator_with(start_jobs, [f"op{i}" for i in range(6)])
    session = await open_job(jc)
    for step in (2, 4):
        await _advance(jc, session, 2)
        for hop in session.hops:
            data = f"stage {hop.layers.start} at {step}".encode() * 50
            chunks = _chunks(session.job_id, step, hop.layers.start, hop.layers.end, data)
            await upload(jc, chunks, jc.node(hop.node_id).metadata)
    info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=session.job_id))
    assert info.checkpoint_step == 4
    # A stage's checker may download that stage's part (to open its shadow), no other.
    checker = session.checkers[0]
    own = training_pb2.DownloadCheckpointRequest(
        job_id=session.job_id, step=4, layers=checker.layers
    )
    metadata = jc.node(checker.node_id).metadata
    chunks = [c async for c in jc.store_stub.DownloadCheckpoint(own, metadata=metadata)]
    assert chunks[0].header.step == 4
    for other in [h for h in session.hops if h.layers != checker.layers]:
        foreign = training_pb2.DownloadCheckpointRequest(
            job_id=session.job_id, step=4, layers=other.layers
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            _ = [c async for c in jc.store_stub.DownloadCheckpoint(foreign, metadata=metadata)]
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED

    request = jobs_pb2.StageFailureRequest(
        job_id=session.job_id, capability=session.capability, stage=0,
        node_id=session.hops[0].node_id, cause="redundant check failed", restore_at_most=3,
    )  # fmt: skip
    replanned = await report_failure(jc, request)
    assert replanned.restore_step == 2 and replanned.job.step == 2
    assert {p.layers.start for p in replanned.restore} == {h.layers.start for h in session.hops}
    assert jc.jobs.manager.repo.checkpoint_parts(session.job_id, 4) == []

    # restore_at_most never moves a job forward, and 0 means the model's own weights.
    again = jobs_pb2.StageFailureRequest(
        job_id=session.job_id, capability=replanned.capability, stage=0,
        node_id=replanned.hops[0].node_id, cause="redundant check failed", restore_at_most=0,
    )  # fmt: skip
    fresh = await report_failure(jc, again)
    assert fresh.restore_step == 0 and list(fresh.restore) == []
