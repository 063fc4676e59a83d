"""TrainingStore on a real coordinator: node-authenticated uploads and downloads, consistency
across stages, refusal of hostile uploads, and --output-model export of real trainer states.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from jobs.jobs_harness import (
    MODEL,
    NUM_LAYERS,
    JobsCoordinator,
    aiter_of,
    hyper,
    layers,
    model_messages,
)
from safetensors.numpy import load_file
from support.coordinator_harness import harness_settings, wait_until

from coordinator.model_store import open_checkpoint
from coordinator.server import running_coordinator
from node_agent.runtime.stage_loader import load_stage_model
from node_agent.runtime.training import StageTrainer, state_to_bytes
from protos.tessera.v1 import jobs_pb2, training_pb2


def _chunks(
    job_id: str, step: int, start: int, end: int, data: bytes, **header_fields
) -> list[training_pb2.CheckpointChunk]:
    header = training_pb2.CheckpointHeader(
        job_id=job_id, step=step, layers=layers(start, end), total_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )  # fmt: skip
    for key, value in header_fields.items():
        setattr(header, key, value)
    half = len(data) // 2
    return [
        training_pb2.CheckpointChunk(header=header, offset=0, data=data[:half]),
        training_pb2.CheckpointChunk(offset=half, data=data[half:]),
    ]


def _upload(jc: JobsCoordinator, chunks, metadata) -> training_pb2.CheckpointReceipt:
    """UploadCheckpoint through the sync stub: it reports the server's status as sent."""
    import grpc as sync_grpc

    channel = sync_grpc.insecure_channel(jc.coordinator.address)
    try:
        from protos.tessera.v1 import training_pb2_grpc

        stub = training_pb2_grpc.TrainingStoreStub(channel)
        return stub.UploadCheckpoint(iter(chunks), metadata=metadata)
    finally:
        channel.close()


async def upload(jc: JobsCoordinator, chunks, metadata) -> training_pb2.CheckpointReceipt:
    return await asyncio.to_thread(_upload, jc, chunks, metadata)


async def _running_job(jc: JobsCoordinator, **overrides) -> jobs_pb2.TrainingSession:
    dataset = await jc.upload(np.arange(400, dtype=np.int32) % 60)
    job = await jc.submit(dataset.id, **overrides)
    return await jc.stub.OpenTrainingSession(jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id))


async def _advance(jc: JobsCoordinator, session: jobs_pb2.TrainingSession, steps: int) -> None:
    info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=session.job_id))
    for step in range(info.step, info.step + steps):
        await jc.stub.ReportStep(
            jobs_pb2.ReportStepRequest(
                job_id=session.job_id, capability=session.capability, step=step, loss=1.0
            )
        )


async def test_a_checkpoint_is_consistent_once_every_stage_uploaded(jc: JobsCoordinator) -> None:
    session = await _running_job(jc)
    await _advance(jc, session, 2)
    parts = {}
    for index, hop in enumerate(session.hops):
        data = f"state of stage {index} at step 2".encode() * 100
        parts[(hop.layers.start, hop.layers.end)] = data
        node = jc.node(hop.node_id)
        receipt = await upload(
            jc, _chunks(session.job_id, 2, hop.layers.start, hop.layers.end, data), node.metadata
        )
        assert receipt.sha256 == hashlib.sha256(data).hexdigest()
        assert receipt.consistent == (index == len(session.hops) - 1)
    info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=session.job_id))
    assert info.checkpoint_step == 2

    # Each stage's node downloads exactly its part, intact.
    for hop in session.hops:
        request = training_pb2.DownloadCheckpointRequest(
            job_id=session.job_id, step=2, layers=hop.layers
        )
        chunks = [
            c
            async for c in jc.store_stub.DownloadCheckpoint(
                request, metadata=jc.node(hop.node_id).metadata
            )
        ]
        assert (
            chunks[0].header.sha256
            == hashlib.sha256(parts[(hop.layers.start, hop.layers.end)]).hexdigest()
        )
        assert b"".join(c.data for c in chunks) == parts[(hop.layers.start, hop.layers.end)]

    # A re-opened session (resume) restores from it, and every part is listed.
    reopened = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=session.job_id)
    )
    assert reopened.restore_step == 2 and reopened.job.step == 2
    assert {(p.layers.start, p.layers.end): p.sha256 for p in reopened.restore} == {
        k: hashlib.sha256(v).hexdigest() for k, v in parts.items()
    }


async def test_hostile_uploads_are_refused(jc: JobsCoordinator) -> None:
    session = await _running_job(jc)
    await _advance(jc, session, 2)
    hop = session.hops[0]
    owner = jc.node(hop.node_id)
    other = next(n for n in jc.nodes if n.node_id not in {h.node_id for h in session.hops})
    data = b"x" * 1000
    start, end = hop.layers.start, hop.layers.end
    good = _chunks(session.job_id, 2, start, end, data)
    wrong_ticket = (("x-tessera-node-id", owner.node_id), ("x-tessera-ticket", "00" * 32))
    tampered = [good[0], training_pb2.CheckpointChunk(offset=500, data=b"y" * 500)]
    mine = owner.metadata

    def part(step: int = 2, a: int = start, b: int = end, **fields) -> list:
        return _chunks(session.job_id, step, a, b, data, **fields)

    stray = training_pb2.CheckpointChunk(offset=7, data=b"z")
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (grpc.StatusCode.UNAUTHENTICATED, good, ()),
        (grpc.StatusCode.UNAUTHENTICATED, good, wrong_ticket),
        (grpc.StatusCode.NOT_FOUND, _chunks("j-nope", 2, start, end, data), mine),
        (grpc.StatusCode.PERMISSION_DENIED, good, other.metadata),  # not its stage
        (invalid, part(a=0, b=NUM_LAYERS), mine),  # no such stage
        (invalid, part(step=9), mine),  # a step the job never reached
        (invalid, part(step=0), mine),
        (invalid, tampered, mine),  # hash mismatch
        (invalid, good[:1], mine),  # truncated
        (invalid, [good[1]], mine),  # no header
        (invalid, [good[0], good[0]], mine),  # two headers
        (invalid, [good[0], stray], mine),  # a gap
        (invalid, part(sha256="nothex"), mine),
        (invalid, part(total_bytes=10), mine),  # more bytes than declared
        (grpc.StatusCode.RESOURCE_EXHAUSTED, part(total_bytes=1 << 40), mine),
    ]
    for code, chunks, metadata in cases:
        with pytest.raises(grpc.RpcError) as caught:
            await upload(jc, chunks, metadata)
        assert caught.value.code() == code, (code, caught.value.details())
    info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=session.job_id))
    assert info.checkpoint_step == 0
    assert list(jc.jobs.blobs.incoming.iterdir()) == []
    dataset = await jc.stub.GetDataset(jobs_pb2.DatasetRef(id=info.dataset_id))
    assert set(jc.jobs.blobs.all_digests()) == {s.sha256 for s in dataset.shards}

    # Downloads: only the stage's own node, only stored parts.
    request = training_pb2.DownloadCheckpointRequest(
        job_id=session.job_id, step=2, layers=hop.layers
    )
    unknown = training_pb2.DownloadCheckpointRequest(job_id="j-nope")
    for code, metadata, req in [
        (grpc.StatusCode.UNAUTHENTICATED, (), request),
        (grpc.StatusCode.PERMISSION_DENIED, other.metadata, request),
        (grpc.StatusCode.NOT_FOUND, mine, request),  # nothing stored at step 2
        (grpc.StatusCode.NOT_FOUND, mine, unknown),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [c async for c in jc.store_stub.DownloadCheckpoint(req, metadata=metadata)]
        assert caught.value.code() == code


async def test_uploads_for_a_finished_job_are_refused(jc: JobsCoordinator) -> None:
    session = await _running_job(jc, steps=1)
    await _advance(jc, session, 1)
    await jc.stub.FinishJob(
        jobs_pb2.FinishJobRequest(
            job_id=session.job_id, capability=session.capability, state=jobs_pb2.JOB_STATE_DONE
        )
    )
    hop = session.hops[0]
    chunks = _chunks(session.job_id, 1, hop.layers.start, hop.layers.end, b"late" * 10)
    with pytest.raises(grpc.RpcError) as caught:
        await upload(jc, chunks, jc.node(hop.node_id).metadata)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _trainer(model_dir: Path, start: int, end: int, mode: str) -> StageTrainer:
    h = hyper(mode=mode)
    return StageTrainer(
        load_stage_model(model_dir, start, end), mode, lora_rank=h.lora_rank,  # type: ignore[arg-type]
        lora_alpha=h.lora_alpha, lr=0.05, seed=h.seed,
    )  # fmt: skip


def _train_one_step(trainers: list[StageTrainer]) -> None:
    """One real optimizer step through the stages in one process (numbers only matter for
    making the weights differ from the base model)."""
    tokens = torch.arange(8).reshape(1, 8) % 60
    x = tokens
    outputs = []
    for index, trainer in enumerate(trainers):
        last = index == len(trainers) - 1
        x = trainer.forward(
            0, x if index == 0 else x.requires_grad_(False), tokens if last else None
        )
        outputs.append(x)
    grad = None
    for trainer in reversed(trainers):
        grad = trainer.backward(0, grad)
    for trainer in trainers:
        trainer.step(1.0, trainer.version)


@pytest.mark.parametrize("mode", ["full", "lora"])
async def test_output_model_holds_the_trained_weights(
    jc: JobsCoordinator, tiny_model: Path, tmp_path: Path, mode: str
) -> None:
    session = await _running_job(jc, steps=1, output_model=f"tiny-{mode}", hyper=hyper(mode=mode))
    hops = [(h.layers.start, h.layers.end) for h in session.hops]
    trainers = [_trainer(tiny_model, a, b, mode) for a, b in hops]
    _train_one_step(trainers)
    await _advance(jc, session, 1)
    finish = jobs_pb2.FinishJobRequest(
        job_id=session.job_id, capability=session.capability, state=jobs_pb2.JOB_STATE_DONE
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # no final checkpoint yet
        await jc.stub.FinishJob(finish)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    for hop, trainer in zip(session.hops, trainers, strict=True):
        data = state_to_bytes(*trainer.state_dict())
        chunks = _chunks(session.job_id, 1, hop.layers.start, hop.layers.end, data)
        await upload(jc, chunks, jc.node(hop.node_id).metadata)
    done = await jc.stub.FinishJob(finish)
    assert done.state == jobs_pb2.JOB_STATE_DONE

    # The new model is in the store, and its tensors are the trainers' weights (LoRA merged).
    info = {m.name: m for m in jc.coordinator.ctx.model_store.models()}
    assert f"tiny-{mode}" in info
    store = jc.coordinator.ctx.model_store
    expected: dict[str, np.ndarray] = {}
    for trainer in trainers:
        expected.update({k: v.numpy() for k, v in trainer.trained_weights().items()})
    base = load_file(str(tiny_model / "model.safetensors"))
    changed = 0
    for tensor in store.tensors(f"tiny-{mode}"):
        raw = store.blobs.path(tensor.sha256).read_bytes()
        value = np.frombuffer(raw, dtype="<f4").reshape(tensor.shape)
        np.testing.assert_allclose(value, expected[tensor.name], rtol=1e-5, atol=1e-6)
        changed += not np.array_equal(value, base[tensor.name])
    assert changed > 0
    # Same architecture and tokenizer as the base model; served like any imported model.
    base_config = json.loads(open_checkpoint(tiny_model).config_json)
    assert json.loads(store.model(f"tiny-{mode}").config_json) == base_config
    assert store.catalog.tokenizer_json(f"tiny-{mode}") == store.catalog.tokenizer_json(MODEL)


async def test_jobs_datasets_and_checkpoints_survive_a_coordinator_restart(
    tmp_path: Path, tiny_model: Path
) -> None:
    settings = harness_settings(tmp_path / "restart", min_stages=NUM_LAYERS, replicas=1)
    async with running_coordinator(settings) as coordinator:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            jc = JobsCoordinator(coordinator, channel)
            await coordinator.ctx.model_store.import_model(
                aiter_of(model_messages(tiny_model, MODEL))
            )
            for index in range(NUM_LAYERS):
                await jc.add_node(f"n{index}")
            await jc.ready(replicas=1)
            session = await _running_job(jc)
            await _advance(jc, session, 2)
            for hop in session.hops:
                chunks = _chunks(session.job_id, 2, hop.layers.start, hop.layers.end, b"s" * 99)
                await upload(jc, chunks, jc.node(hop.node_id).metadata)
            for node in jc.nodes:
                await node.leave()

    async with running_coordinator(settings) as coordinator:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            jc = JobsCoordinator(coordinator, channel)
            info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=session.job_id))
            assert info.state == jobs_pb2.JOB_STATE_RUNNING and info.step == 2
            assert info.checkpoint_step == 2 and [p.step for p in info.losses] == [0, 1]
            chunks = [c async for c in jc.stub.DownloadDataset(
                jobs_pb2.DatasetRef(id=info.dataset_id))]  # fmt: skip
            assert chunks[0].header.shards
            # The training state stays counted against the stages' nodes.
            placement = coordinator.ctx.planner
            assert all(placement.training_bytes(h.node_id) > 0 for h in session.hops)
            # The driver's session outlives the restart: its next report is accepted.
            await jc.stub.ReportStep(
                jobs_pb2.ReportStepRequest(
                    job_id=session.job_id, capability=session.capability, step=2, loss=0.5
                )
            )


async def test_a_job_that_ended_long_ago_goes_with_its_checkpoints_and_then_its_dataset(
    jc: JobsCoordinator,
) -> None:
    ended = await _running_job(jc, steps=2)
    await _advance(jc, ended, 2)
    for index, hop in enumerate(ended.hops):
        data = f"state of stage {index} at step 2".encode() * 100
        chunks = _chunks(ended.job_id, 2, hop.layers.start, hop.layers.end, data)
        await upload(jc, chunks, jc.node(hop.node_id).metadata)
    finish = jobs_pb2.FinishJobRequest(
        job_id=ended.job_id, capability=ended.capability, state=jobs_pb2.JOB_STATE_DONE
    )
    await jc.stub.FinishJob(finish)
    ended_info = await jc.stub.GetJob(jobs_pb2.JobRef(job_id=ended.job_id))
    other_data = await jc.upload(np.arange(500, dtype=np.int32) % 50)
    running = await jc.submit(other_data.id)
    await jc.stub.OpenTrainingSession(jobs_pb2.OpenTrainingSessionRequest(job_id=running.job_id))
    never_opened = await jc.submit(other_data.id)
    before = set(jc.jobs.blobs.all_digests())
    record = jc.jobs.repo.dataset(ended_info.dataset_id)
    assert record is not None
    dataset_blobs = {shard.sha256 for shard in record.shards}
    later = int(time.time() * 1000) + 1

    removed = await jc.jobs.prune_jobs(later)  # not the running one
    assert sorted(removed) == sorted([ended.job_id, never_opened.job_id])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jc.stub.GetJob(jobs_pb2.JobRef(job_id=ended.job_id))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "a job is deleted 30 days after it ended" in caught.value.details()
    listed = await jc.stub.ListJobs(jobs_pb2.ListJobsRequest())
    assert [j.job_id for j in listed.jobs] == [running.job_id]
    # Its checkpoints' blobs are gone, its dataset's stay until the dataset sweep.
    left = set(jc.jobs.blobs.all_digests())
    assert len(before - left) == len(ended.hops) and dataset_blobs <= left
    assert await jc.jobs.prune_datasets(later) == [ended_info.dataset_id]
    assert not dataset_blobs & set(jc.jobs.blobs.all_digests())
    assert (await jc.stub.GetJob(jobs_pb2.JobRef(job_id=running.job_id))).state == (
        jobs_pb2.JOB_STATE_RUNNING
    )


async def test_the_coordinator_deletes_ended_jobs_by_itself(start_jobs) -> None:
    jc = await start_jobs(job_retention_s=0.2, dataset_ttl_s=0)
    await jc.ready(replicas=2)
    session = await _running_job(jc, steps=1)
    await _advance(jc, session, 1)
    await jc.stub.FinishJob(
        jobs_pb2.FinishJobRequest(
            job_id=session.job_id, capability=session.capability, state=jobs_pb2.JOB_STATE_DONE
        )
    )
    await wait_until(lambda: jc.jobs.repo.job(session.job_id) is None, 10.0, "the ended job to go")
    # With the dataset TTL off, its dataset stays.
    assert jc.jobs.repo.dataset(session.job.dataset_id) is not None
