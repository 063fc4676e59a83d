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
from support.hostile import huge, refused

from protos import codec
from protos.tessera.v1 import jobs_pb2

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
    await refused(stub.GetJob(oversized), grpc.StatusCode.RESOURCE_EXHAUSTED, "")
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
            "",
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
