"""Jobs RPCs on a real coordinator: submit, sessions, progress, re-planning, memory, events."""

from __future__ import annotations

import asyncio
import math

import grpc
import numpy as np
import pytest
from jobs.jobs_harness import MODEL, NUM_LAYERS, JobsCoordinator, hyper, submit_request
from support.coordinator_harness import wait_until

from coordinator.jobs.memory import training_state_bytes
from coordinator.model_store.layout import ModelLayout
from protos import identity
from protos.tessera.v1 import client_api_pb2, jobs_pb2

TOKENS = np.arange(400, dtype=np.int32) % 60


async def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code()


async def _job(jc: JobsCoordinator, **overrides) -> jobs_pb2.JobInfo:
    dataset = await jc.upload(TOKENS)
    return await jc.submit(dataset.id, **overrides)


async def test_submit_validates_everything(jc: JobsCoordinator) -> None:
    dataset = await jc.upload(TOKENS)
    big_vocab = await jc.upload(np.array([0, 1, 5000] * 20, dtype=np.int32))
    examples = await jc.upload(np.arange(100, dtype=np.int32) % 60, example_len=10)
    bad = {
        grpc.StatusCode.NOT_FOUND: [
            dict(model="nope"), dict(dataset_id="0" * 64), dict(dataset_id=""),
        ],
        grpc.StatusCode.INVALID_ARGUMENT: [
            dict(steps=0), dict(steps=10**12), dict(batch_size=0), dict(seq_len=0),
            dict(seq_len=400), dict(checkpoint_every=4_000_000_000),
            dict(hyper=hyper(mode="sideways")), dict(hyper=hyper(lr=0.0)),
            dict(hyper=hyper(lr=math.nan)), dict(hyper=hyper(beta1=1.0)),
            dict(hyper=hyper(eps=0.0)), dict(hyper=hyper(weight_decay=-1.0)),
            dict(hyper=hyper(micro_batches=3)), dict(hyper=hyper(micro_batches=0)),
            dict(hyper=hyper(mode="lora", lora_rank=0)),
            dict(hyper=hyper(mode="lora", lora_alpha=math.inf)),
            dict(dataset_id=big_vocab.id), dict(dataset_id=examples.id, seq_len=4),
            dict(output_model="bad name!"), dict(account="x" * 300),
        ],
        grpc.StatusCode.ALREADY_EXISTS: [dict(output_model=MODEL)],
    }  # fmt: skip
    for code, cases in bad.items():
        for overrides in cases:
            overrides.setdefault("dataset_id", dataset.id)
            got = await _code(jc.stub.SubmitJob(submit_request(**overrides)))
            assert got == code, overrides
    ok = await jc.submit(examples.id, seq_len=9)
    assert ok.state == jobs_pb2.JOB_STATE_QUEUED and ok.step == 0
    listed = await jc.stub.ListJobs(jobs_pb2.ListJobsRequest())
    assert [j.job_id for j in listed.jobs] == [ok.job_id]  # refused submits left no record


async def test_unknown_job_is_not_found_everywhere(jc: JobsCoordinator) -> None:
    ref = jobs_pb2.JobRef(job_id="j0000")
    assert await _code(jc.stub.GetJob(ref)) == grpc.StatusCode.NOT_FOUND
    huge = jobs_pb2.OpenTrainingSessionRequest(job_id="x" * 10_000)
    assert await _code(jc.stub.OpenTrainingSession(huge)) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _ = [e async for e in jc.stub.WatchJob(ref)]
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    report = jobs_pb2.ReportStepRequest(job_id="j0000")
    assert await _code(jc.stub.ReportStep(report)) == grpc.StatusCode.NOT_FOUND


async def test_session_covers_the_model_with_a_verifiable_capability(jc: JobsCoordinator) -> None:
    job = await _job(jc)
    session = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
    )
    assert [(h.layers.start, h.layers.end) for h in session.hops] == [
        (i, i + 1) for i in range(NUM_LAYERS)
    ]
    assert len({h.node_id for h in session.hops}) == NUM_LAYERS
    for hop in session.hops:  # every hop's node really holds (a shard covering) that range
        start, end = jc.node(hop.node_id).shards[MODEL]
        assert start <= hop.layers.start < hop.layers.end <= end
    claims = identity.open_capability(jc.coordinator.ctx.public_key, session.capability)
    assert claims is not None and claims.session_id == job.job_id and claims.model == MODEL
    assert [g.node_id for g in claims.grants] == [h.node_id for h in session.hops]
    assert session.restore_step == 0 and session.job.state == jobs_pb2.JOB_STATE_RUNNING
    # The training state is counted against each stage node's memory.
    placement = jc.coordinator.ctx.planner
    layout = ModelLayout.from_config(
        __import__("json").loads(jc.coordinator.ctx.model_store.model(MODEL).config_json)
    )
    for hop in session.hops:
        expected = training_state_bytes(layout, hop.layers.start, hop.layers.end, "full", 4, 32)
        assert placement.training_bytes(hop.node_id) == expected > 0


async def test_steps_are_reported_in_order_by_the_current_driver_only(
    jc: JobsCoordinator,
) -> None:
    job = await _job(jc)
    open_request = jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
    first = await jc.stub.OpenTrainingSession(open_request)

    def report(step: int, capability=first.capability, **fields) -> jobs_pb2.ReportStepRequest:
        values = dict(loss=2.5, grad_norm=1.0, tokens=32, tokens_per_s=100.0, stage_ms=[1, 2, 3])
        values.update(fields)
        return jobs_pb2.ReportStepRequest(
            job_id=job.job_id, capability=capability, step=step, **values
        )

    await jc.stub.ReportStep(report(0))
    await jc.stub.ReportStep(report(1, loss=2.0))
    for bad in (report(1), report(5)):  # repeated with another loss, skipped ahead
        assert await _code(jc.stub.ReportStep(bad)) == grpc.StatusCode.FAILED_PRECONDITION
    # The very report of the last step again: a driver's retry whose answer was lost (the
    # coordinator restarted). Taken, and nothing changes.
    await jc.stub.ReportStep(report(1, loss=2.0))
    assert await _code(jc.stub.ReportStep(report(0))) == grpc.StatusCode.FAILED_PRECONDITION
    for bad in (report(2, loss=math.nan), report(2, tokens_per_s=-1.0),
                report(2, stage_ms=[1, 2, 3, 4])):  # fmt: skip
        assert await _code(jc.stub.ReportStep(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    forged = client_api_pb2.SignedCapability(claims=first.capability.claims, signature=b"\0" * 64)
    assert await _code(jc.stub.ReportStep(report(2, forged))) == grpc.StatusCode.UNAUTHENTICATED
    other = await _job(jc)
    other_session = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=other.job_id)
    )
    assert (
        await _code(jc.stub.ReportStep(report(2, other_session.capability)))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=job.job_id))
    assert info.step == 2 and [(p.step, p.loss) for p in info.losses] == [(0, 2.5), (1, 2.0)]

    # A second driver (--resume) takes over; it rolls back to the last checkpoint (none: 0).
    second = await jc.stub.OpenTrainingSession(open_request)
    assert second.restore_step == 0 and second.job.step == 0
    assert await _code(jc.stub.ReportStep(report(0))) == grpc.StatusCode.FAILED_PRECONDITION
    await jc.stub.ReportStep(report(0, second.capability, loss=2.4))
    info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=job.job_id))
    assert info.losses[0].loss == pytest.approx(2.4)


async def test_stage_failure_replans_onto_another_ready_holder(jc: JobsCoordinator) -> None:
    job = await _job(jc)
    session = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
    )
    failed = session.hops[1]
    request = jobs_pb2.StageFailureRequest(
        job_id=job.job_id, capability=session.capability, stage=1, node_id=failed.node_id,
        cause="UNAVAILABLE: connection refused",
    )  # fmt: skip
    for bad in (
        jobs_pb2.StageFailureRequest(job_id=job.job_id, capability=session.capability, stage=9),
        jobs_pb2.StageFailureRequest(
            job_id=job.job_id, capability=session.capability, stage=1, node_id="someone-else"
        ),
    ):
        assert await _code(jc.stub.ReportStageFailure(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    replanned = await jc.stub.ReportStageFailure(request)
    new = replanned.hops[1]
    assert replanned.replaced_stage == 1
    assert new.node_id != failed.node_id
    assert new.node_id not in {session.hops[0].node_id, session.hops[2].node_id}
    start, end = jc.node(new.node_id).shards[MODEL]  # its shard covers the failed stage
    assert start <= 1 and 2 <= end
    assert [h.node_id for i, h in enumerate(replanned.hops) if i != 1] == [
        session.hops[0].node_id, session.hops[2].node_id
    ]  # fmt: skip
    placement = jc.coordinator.ctx.planner
    assert placement.training_bytes(failed.node_id) == 0 < placement.training_bytes(new.node_id)
    # The old capability is superseded by the re-planned session's.
    stale = jobs_pb2.ReportStepRequest(job_id=job.job_id, capability=session.capability, step=0)
    assert await _code(jc.stub.ReportStep(stale)) == grpc.StatusCode.FAILED_PRECONDITION
    info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=job.job_id))
    assert info.replans == 1 and info.stages[1].node_id == new.node_id
    # The very report again: the driver's retry after losing the answer (a coordinator
    # restart). It gets the same re-plan, and nothing moves. Another report under the old
    # session is refused as before.
    repeated = await jc.stub.ReportStageFailure(request)
    assert repeated.replaced_stage == 1 and repeated.capability == replanned.capability
    assert [h.node_id for h in repeated.hops] == [h.node_id for h in replanned.hops]
    info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=job.job_id))
    assert info.replans == 1 and info.stages[1].node_id == new.node_id
    other_stage = jobs_pb2.StageFailureRequest(
        job_id=job.job_id, capability=session.capability, stage=0,
        node_id=session.hops[0].node_id,
    )  # fmt: skip
    assert await _code(jc.stub.ReportStageFailure(other_stage)) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )

    # Nobody else holds layer 1 once the replacement fails too: UNAVAILABLE (job intact)
    # while placement has a spare node load the layers; a retry then gets that node.
    again = jobs_pb2.StageFailureRequest(
        job_id=job.job_id, capability=replanned.capability, stage=1, node_id=new.node_id
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jc.stub.ReportStageFailure(again)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "loading layers [1, 2)" in caught.value.details()
    info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=job.job_id))
    assert info.stages[1].node_id == new.node_id and info.state == jobs_pb2.JOB_STATE_RUNNING
    busy = {failed.node_id, new.node_id, session.hops[0].node_id, session.hops[2].node_id}
    for _ in range(200):
        try:
            third = await jc.stub.ReportStageFailure(again)
            break
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            await asyncio.sleep(0.05)
    spare = third.hops[1].node_id
    assert spare not in busy
    # The first report, repeated now, is history: the job moved on since.
    assert await _code(jc.stub.ReportStageFailure(request)) == grpc.StatusCode.FAILED_PRECONDITION
    start, end = jc.node(spare).shards[MODEL]
    assert start <= 1 and end >= 2  # it loaded a shard covering the stage's layers


async def test_a_node_without_memory_for_the_training_state_gets_no_stage(start_jobs) -> None:
    # Three roomy nodes for layers 0 and 2 and one tight one for layer 1: the tiny model's
    # shard fits, but not a training state for a batch of 16 x 64 tokens.
    jc = await start_jobs(nodes=0, replicas=1)
    for i in range(2):
        await jc.add_node(f"big{i}")
    tight = await jc.add_node("tight", memory_usable_bytes=3_000_000)
    await jc.ready(replicas=1)
    # Placement settles as the nodes join one by one; wait until the tight node has a shard.
    await wait_until(lambda: MODEL in tight.shards, 10.0, "the tight node to hold a shard")
    await jc.ready(replicas=1)
    dataset = await jc.upload(np.arange(5000, dtype=np.int32) % 60)
    job = await jc.submit(dataset.id, batch_size=16, seq_len=64, hyper=hyper(micro_batches=4))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jc.stub.OpenTrainingSession(jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "lora" in caught.value.details() and tight.node_id in caught.value.details()
    # A small enough job (LoRA, short sequences) fits on the same node.
    small = await jc.submit(dataset.id, batch_size=2, seq_len=8, hyper=hyper(mode="lora"))
    session = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=small.job_id)
    )
    assert tight.node_id in {h.node_id for h in session.hops}


async def test_watch_streams_progress_events(jc: JobsCoordinator) -> None:
    job = await _job(jc, steps=2)
    session = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
    )
    events: list[jobs_pb2.JobEvent] = []

    async def watch() -> None:
        async for event in jc.stub.WatchJob(jobs_pb2.JobRef(job_id=job.job_id)):
            events.append(event)

    watcher = asyncio.get_running_loop().create_task(watch())
    while not events:
        await asyncio.sleep(0.01)
    for step in range(2):
        await jc.stub.ReportStep(
            jobs_pb2.ReportStepRequest(
                job_id=job.job_id, capability=session.capability, step=step, loss=3.0 - step,
                tokens_per_s=50.0,
            )
        )  # fmt: skip
    await jc.stub.FinishJob(
        jobs_pb2.FinishJobRequest(
            job_id=job.job_id, capability=session.capability, state=jobs_pb2.JOB_STATE_DONE
        )
    )
    await asyncio.wait_for(watcher, 10)  # the stream ends with the job
    kinds = [e.kind for e in events]
    assert kinds[0] == "snapshot" and kinds[-1] == "state"
    steps = [(e.step, e.loss) for e in events if e.kind == "step"]
    assert steps == [(0, 3.0), (1, 2.0)]
    assert events[-1].job.state == jobs_pb2.JOB_STATE_DONE


async def test_finish_rules(jc: JobsCoordinator) -> None:
    job = await _job(jc, steps=1)
    session = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
    )

    def finish(state, **fields) -> jobs_pb2.FinishJobRequest:
        return jobs_pb2.FinishJobRequest(
            job_id=job.job_id, capability=session.capability, state=state, **fields
        )

    assert await _code(jc.stub.FinishJob(finish(jobs_pb2.JOB_STATE_DONE))) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )  # no step was trained yet
    assert await _code(jc.stub.FinishJob(finish(jobs_pb2.JOB_STATE_RUNNING))) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    paused = await jc.stub.FinishJob(finish(jobs_pb2.JOB_STATE_PAUSED))
    assert paused.state == jobs_pb2.JOB_STATE_PAUSED
    # The same end again (a retry whose answer was lost) is answered as the first; another
    # end is refused.
    assert (await jc.stub.FinishJob(finish(jobs_pb2.JOB_STATE_PAUSED))) == paused
    assert await _code(jc.stub.FinishJob(finish(jobs_pb2.JOB_STATE_FAILED))) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    assert jc.coordinator.ctx.planner.training_bytes(session.hops[0].node_id) == 0
    resumed = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
    )
    failed = await jc.stub.FinishJob(
        jobs_pb2.FinishJobRequest(
            job_id=job.job_id, capability=resumed.capability, state=jobs_pb2.JOB_STATE_FAILED,
            error="the user gave up",
        )
    )  # fmt: skip
    assert failed.state == jobs_pb2.JOB_STATE_FAILED and failed.error == "the user gave up"
    # The first session's paused end, repeated now, is another session's: refused.
    assert await _code(jc.stub.FinishJob(finish(jobs_pb2.JOB_STATE_PAUSED))) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    reopen = jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
    assert await _code(jc.stub.OpenTrainingSession(reopen)) == grpc.StatusCode.FAILED_PRECONDITION
