"""Hostile input to the Jobs service, which any client can call: huge, empty and
control-character job ids, dataset ids and model names, absurd numbers, and messages over
the size limit, on every RPC that takes them.

Each is refused with the right status and a short message (error details travel in gRPC
metadata, which a client refuses past 16 KiB: a message that repeats a huge name arrives
as RESOURCE_EXHAUSTED "Stream removed" instead of the real reason), no record is left, and
the coordinator goes on serving: a good job is submitted and listed afterwards.
"""

from __future__ import annotations

import grpc
import numpy as np
from jobs.jobs_harness import JobsCoordinator, submit_request
from support.coordinator_harness import wait_until
from support.hostile import huge, refused

from coordinator.jobs.limits import JobLimits
from protos import codec
from protos.tessera.v1 import client_api_pb2, jobs_pb2

HUGE = huge("j")


async def test_reads_refuse_huge_and_empty_ids_briefly(start_jobs) -> None:
    jc: JobsCoordinator = await start_jobs(nodes=0)
    stub = jc.stub
    for job_id in (HUGE, ""):
        ref = jobs_pb2.JobRef(job_id=job_id)
        details = await refused(stub.GetJob(ref), grpc.StatusCode.NOT_FOUND, "no job")
        assert "\x1b" not in details and "\n" not in details  # quoted, never raw
        await refused(stub.WatchJob(ref), grpc.StatusCode.NOT_FOUND, "no job")
        finish = jobs_pb2.FinishJobRequest(job_id=job_id, state=jobs_pb2.JOB_STATE_DONE)
        await refused(stub.FinishJob(finish), grpc.StatusCode.NOT_FOUND, "no job")
        failure = jobs_pb2.StageFailureRequest(job_id=job_id, node_id=HUGE, cause=HUGE)
        await refused(stub.ReportStageFailure(failure), grpc.StatusCode.NOT_FOUND, "no job")
    for dataset_id in (HUGE, ""):
        ref = jobs_pb2.DatasetRef(id=dataset_id)
        await refused(stub.GetDataset(ref), grpc.StatusCode.NOT_FOUND, "no dataset")
        await refused(stub.DownloadDataset(ref), grpc.StatusCode.NOT_FOUND, "no dataset")
    oversized = jobs_pb2.JobRef(job_id="x" * (codec.MAX_MESSAGE_BYTES + 10))
    await refused(stub.GetJob(oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
    # An absurd list limit is capped, not an error.
    assert list((await stub.ListJobs(jobs_pb2.ListJobsRequest(limit=2**32 - 1))).jobs) == []


async def test_submit_refuses_huge_names_briefly_and_records_nothing(start_jobs) -> None:
    jc: JobsCoordinator = await start_jobs(nodes=0)
    dataset = await jc.upload(np.arange(400, dtype=np.int32) % 60)
    cases = [
        (dict(output_model=HUGE), grpc.StatusCode.INVALID_ARGUMENT, "model name"),
        (dict(model=HUGE), grpc.StatusCode.NOT_FOUND, "unknown model"),
        (dict(dataset_id=HUGE), grpc.StatusCode.NOT_FOUND, "no dataset"),
        (dict(account=HUGE), grpc.StatusCode.INVALID_ARGUMENT, "account"),
        (dict(steps=2**64 - 1), grpc.StatusCode.INVALID_ARGUMENT, "steps"),
        (
            dict(output_model="x" * (codec.MAX_MESSAGE_BYTES + 10)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
    ]
    for overrides, code, words in cases:
        overrides.setdefault("dataset_id", dataset.id)
        await refused(jc.stub.SubmitJob(submit_request(**overrides)), code, words)
    assert list((await jc.stub.ListJobs(jobs_pb2.ListJobsRequest())).jobs) == []

    # Still serving: a good job is taken and listed.
    job = await jc.submit(dataset.id, output_model="tiny-tuned")
    assert job.state == jobs_pb2.JOB_STATE_QUEUED
    listed = await jc.stub.ListJobs(jobs_pb2.ListJobsRequest(limit=2**32 - 1))
    assert [j.job_id for j in listed.jobs] == [job.job_id]


async def test_driver_calls_refuse_foreign_forged_and_oversized_input_and_keep_the_job(
    jc: JobsCoordinator,
) -> None:
    """FinishJob and ReportStageFailure, which only a job's current driver may call: another
    job's genuine capability, a forged or missing one, texts past their 4096-character
    limit, impossible stages and states, and a message over the size limit."""
    dataset = await jc.upload(np.arange(400, dtype=np.int32) % 60)
    ours, theirs = [await jc.submit(dataset.id) for _ in range(2)]
    session, foreign = [
        await jc.stub.OpenTrainingSession(jobs_pb2.OpenTrainingSessionRequest(job_id=j.job_id))
        for j in (ours, theirs)
    ]
    forged = client_api_pb2.SignedCapability(claims=session.capability.claims, signature=b"\0" * 64)
    stage = session.hops[1]

    def finish(capability=session.capability, **fields) -> jobs_pb2.FinishJobRequest:
        fields.setdefault("state", jobs_pb2.JOB_STATE_FAILED)
        return jobs_pb2.FinishJobRequest(job_id=ours.job_id, capability=capability, **fields)

    def failure(capability=session.capability, **fields) -> jobs_pb2.StageFailureRequest:
        fields.setdefault("stage", 1)
        fields.setdefault("node_id", stage.node_id)
        return jobs_pb2.StageFailureRequest(job_id=ours.job_id, capability=capability, **fields)

    for build, call in ((finish, jc.stub.FinishJob), (failure, jc.stub.ReportStageFailure)):
        await refused(call(build(foreign.capability)), grpc.StatusCode.PERMISSION_DENIED, "not job")
        await refused(call(build(forged)), grpc.StatusCode.UNAUTHENTICATED, "not signed")
        await refused(call(build(None)), grpc.StatusCode.UNAUTHENTICATED, "not signed")
    cases = [
        (jc.stub.FinishJob, finish(error=HUGE), grpc.StatusCode.INVALID_ARGUMENT, "4096"),
        (jc.stub.FinishJob, finish(state=9999), grpc.StatusCode.INVALID_ARGUMENT, "DONE"),
        (jc.stub.ReportStageFailure, failure(cause=HUGE), grpc.StatusCode.INVALID_ARGUMENT, "4096"),
        (
            jc.stub.ReportStageFailure,
            failure(stage=2**32 - 1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "no stage",
        ),
        (
            jc.stub.ReportStageFailure,
            failure(node_id=HUGE),
            grpc.StatusCode.INVALID_ARGUMENT,
            stage.node_id,
        ),
        (
            jc.stub.FinishJob,
            finish(error="x" * (codec.MAX_MESSAGE_BYTES + 10)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
    ]
    for call, request, code, words in cases:
        details = await refused(call(request), code, words)
        assert "\x1b" not in details and "\n" not in details  # quoted, never raw

    # Both jobs are as they were: running, on the same stages, never re-planned.
    for job, opened in ((ours, session), (theirs, foreign)):
        info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=job.job_id))
        assert info.state == jobs_pb2.JOB_STATE_RUNNING and info.replans == 0
        assert [s.node_id for s in info.stages] == [h.node_id for h in opened.hops]
    # Still serving: our driver reports a step and pauses the job.
    report = jobs_pb2.ReportStepRequest(
        job_id=ours.job_id, capability=session.capability, step=0, loss=2.0
    )
    await jc.stub.ReportStep(report)
    paused = await jc.stub.FinishJob(finish(state=jobs_pb2.JOB_STATE_PAUSED))
    assert paused.state == jobs_pb2.JOB_STATE_PAUSED and paused.step == 1


async def test_watch_streams_are_capped_and_a_closed_one_frees_its_slot(
    start_jobs,
) -> None:
    """Every open WatchJob stream is a bus subscription that each published event visits:
    a client opening streams without end would slow every job's progress, so past the
    limit a new one is refused, and closing one lets the next in."""
    jc: JobsCoordinator = await start_jobs(nodes=0)
    jc.set_limits(JobLimits(max_watchers=2))
    dataset = await jc.upload(np.arange(400, dtype=np.int32) % 60)
    job = await jc.submit(dataset.id, output_model="tiny-tuned")
    ref = jobs_pb2.JobRef(job_id=job.job_id)
    watchers = [jc.stub.WatchJob(ref) for _ in range(2)]
    for watcher in watchers:
        assert (await watcher.read()).kind == "snapshot"
    details = await refused(jc.stub.WatchJob(ref), grpc.StatusCode.RESOURCE_EXHAUSTED, "GetJob")
    assert "2 WatchJob streams" in details

    watchers.pop().cancel()
    await wait_until(lambda: jc.jobs.watchers == 1, what="the cancelled stream to end")
    # Still serving: the slot is taken again, and the other watcher still gets events.
    again = jc.stub.WatchJob(ref)
    assert (await again.read()).kind == "snapshot"
    assert (await jc.stub.GetJob(ref)).state == jobs_pb2.JOB_STATE_QUEUED
    for watcher in (*watchers, again):
        watcher.cancel()
    await wait_until(lambda: jc.jobs.watchers == 0, what="every stream to end")
