"""Datasets: uploaded once as token shards, deduplicated, downloaded intact; bad uploads refused."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from jobs.jobs_harness import JobsCoordinator, aiter_of
from support.coordinator_harness import wait_until

from client.api import AsyncClient
from client.dataset_cache import DatasetCache
from client.datasets import SHARD_TOKENS, BatchSampler, TokenDataset, upload_messages
from client.errors import CoordinatorError
from coordinator.jobs.limits import JobLimits
from protos.datasets import dataset_id
from protos.tessera.v1 import jobs_pb2


def _header(tokens: np.ndarray, **fields) -> jobs_pb2.DatasetChunk:
    data = tokens.astype("<i4").tobytes()
    header = jobs_pb2.DatasetHeader(
        name="d",
        shards=[
            jobs_pb2.DatasetShard(sha256=hashlib.sha256(data).hexdigest(), num_tokens=len(tokens))
        ],
    )
    for key, value in fields.items():
        setattr(header, key, value)
    return jobs_pb2.DatasetChunk(header=header)


def _data(payload: bytes, shard: int = 0, offset: int = 0) -> jobs_pb2.DatasetChunk:
    return jobs_pb2.DatasetChunk(
        data=jobs_pb2.DatasetData(shard=shard, offset=offset, data=payload)
    )


async def _refused(jc: JobsCoordinator, messages: list) -> grpc.aio.AioRpcError:
    blobs = sorted(jc.jobs.blobs.all_digests())
    jobs = await jc.stub.ListJobs(jobs_pb2.ListJobsRequest())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jc.stub.UploadDataset(aiter_of(messages))
    # Nothing of the refused upload is kept, and the coordinator still answers as before.
    assert sorted(jc.jobs.blobs.all_digests()) == blobs
    assert await jc.stub.ListJobs(jobs_pb2.ListJobsRequest()) == jobs
    return caught.value


async def _downloaded(jc: JobsCoordinator, dataset: str, cache: Path) -> np.ndarray:
    stream = jc.stub.DownloadDataset(jobs_pb2.DatasetRef(id=dataset))
    return (await DatasetCache(cache).download(dataset, stream)).tokens


async def test_upload_is_stored_once_and_comes_back_intact(start_jobs, tmp_path: Path) -> None:
    jc = await start_jobs(nodes=0)
    tokens = np.arange(SHARD_TOKENS + 1000, dtype=np.int32) % 50  # two shards
    dataset = TokenDataset("d", tokens)
    info = await jc.upload(tokens)
    assert info.id == dataset.id == dataset_id(dataset.shard_list(), 0)
    assert info.num_tokens == len(tokens) and len(info.shards) == 2 and info.max_token_id == 49

    blobs_before = sorted(jc.jobs.blobs.all_digests())
    again = await jc.upload(tokens)  # same content: same id, no new blob
    assert again.id == info.id and sorted(jc.jobs.blobs.all_digests()) == blobs_before

    assert (await jc.stub.GetDataset(jobs_pb2.DatasetRef(id=info.id))).num_tokens == len(tokens)
    assert np.array_equal(await _downloaded(jc, info.id, tmp_path), tokens)


async def test_unknown_dataset_is_not_found(start_jobs) -> None:
    jc = await start_jobs(nodes=0)
    for dataset in ("0" * 64, "not-a-digest", ""):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jc.stub.GetDataset(jobs_pb2.DatasetRef(id=dataset))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [c async for c in jc.stub.DownloadDataset(jobs_pb2.DatasetRef(id=dataset))]
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_malformed_uploads_are_refused_and_leave_nothing(start_jobs) -> None:
    jc = await start_jobs(nodes=0)
    tokens = np.arange(100, dtype=np.int32)
    good = tokens.astype("<i4").tobytes()
    cases = {
        "empty stream": [],
        "data first": [_data(good)],
        "two headers": [_header(tokens), _header(tokens)],
        "bad digest string": [_header(tokens, name="d")]
        and [
            jobs_pb2.DatasetChunk(
                header=jobs_pb2.DatasetHeader(
                    name="d", shards=[jobs_pb2.DatasetShard(sha256="xyz", num_tokens=100)]
                )
            )
        ],  # fmt: skip
        "no shards": [jobs_pb2.DatasetChunk(header=jobs_pb2.DatasetHeader(name="d"))],
        "no name": [_header(tokens, name="")],
        "hash mismatch": [_header(tokens), _data(good[:-4] + b"\x01\x00\x00\x00")],
        "negative token": [_header(-tokens - 1), _data((-tokens - 1).astype("<i4").tobytes())],
        "split token": [_header(tokens), _data(good[:3]), _data(good[3:], offset=3)],
        "wrong offset": [_header(tokens), _data(good, offset=8)],
        "too many bytes": [_header(tokens), _data(good + b"\0\0\0\0")],
        "truncated": [_header(tokens), _data(good[:200])],
        "wrong shard": [_header(tokens), _data(good, shard=3)],
        "examples do not divide": [_header(tokens, example_len=7), _data(good)],
    }
    for label, messages in cases.items():
        error = await _refused(jc, messages)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (label, error.details())
    assert list(jc.jobs.blobs.all_digests()) == []
    assert list(jc.jobs.blobs.incoming.iterdir()) == []


async def test_oversized_dataset_is_refused_before_any_byte(start_jobs) -> None:
    jc = await start_jobs(nodes=0)
    jc.set_limits(JobLimits(max_dataset_bytes=1000))
    tokens = np.arange(1000, dtype=np.int32)
    error = await _refused(jc, [_header(tokens)])
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit" in error.details()
    header = _header(tokens[:10])
    header.header.shards.extend(list(header.header.shards))
    jc.set_limits(JobLimits(max_dataset_shards=1))
    assert (await _refused(jc, [header])).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_batches_are_deterministic_and_cover_the_data() -> None:
    tokens = np.arange(9 * 40, dtype=np.int32)
    sampler = BatchSampler(TokenDataset("d", tokens), seq_len=8, batch_size=4, seed=3)
    again = BatchSampler(TokenDataset("d", tokens), seq_len=8, batch_size=4, seed=3)
    first_epoch = []
    for step in range(10):
        inputs, labels = sampler.batch(step)
        assert inputs.shape == labels.shape == (4, 8) and inputs.dtype == np.int64
        assert np.array_equal(labels[:, :-1], inputs[:, 1:])  # labels are the next tokens
        assert np.array_equal(inputs, again.batch(step)[0])
        first_epoch.extend(int(row[0]) // 9 for row in inputs)
    assert sorted(first_epoch) == list(range(40))  # every window once per epoch
    other_seed = BatchSampler(TokenDataset("d", tokens), seq_len=8, batch_size=4, seed=4)
    assert not np.array_equal(other_seed.batch(0)[0], sampler.batch(0)[0])


def test_upload_messages_split_on_token_boundaries() -> None:
    dataset = TokenDataset("d", np.arange(10, dtype=np.int32))
    messages = list(upload_messages(dataset))
    assert messages[0].HasField("header")
    assert all(len(m.data.data) % 4 == 0 for m in messages[1:])


async def test_a_dataset_no_job_uses_is_deleted_with_its_blobs_once_nobody_asks_for_it(
    jc: JobsCoordinator, tmp_path: Path
) -> None:
    unused = await jc.upload(np.arange(3000, dtype=np.int32) % 50)
    used = await jc.upload(np.arange(4000, dtype=np.int32) % 40)
    await jc.submit(used.id)
    asked = await jc.upload(np.arange(5000, dtype=np.int32) % 30)
    blobs = {info.id: {s.sha256 for s in info.shards} for info in (unused, used, asked)}
    cutoff = int(time.time() * 1000) + 1
    await asyncio.sleep(0.01)
    await jc.stub.GetDataset(jobs_pb2.DatasetRef(id=asked.id))  # a client about to submit
    # Committed: another connection (the CLI's, a backup) sees it, and every later write.
    with sqlite3.connect(jc.coordinator.ctx.settings.db_path) as other:
        (used_ms,) = other.execute(
            "SELECT used_ms FROM datasets WHERE id = ?", [asked.id]
        ).fetchone()
    assert used_ms >= cutoff

    assert await jc.jobs.prune_datasets(cutoff) == [unused.id]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jc.stub.GetDataset(jobs_pb2.DatasetRef(id=unused.id))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no job used is deleted 24 h after" in caught.value.details()
    assert "upload it with UploadDataset" in caught.value.details()
    kept = set(jc.jobs.blobs.all_digests())
    assert not blobs[unused.id] & kept and blobs[used.id] | blobs[asked.id] <= kept
    assert np.array_equal(await _downloaded(jc, used.id, tmp_path), np.arange(4000) % 40)
    # A job's dataset stays however old it is; uploaded again, a deleted one is back.
    assert await jc.jobs.prune_datasets(int(time.time() * 1000) + 1) == [asked.id]
    assert (await jc.upload(np.arange(3000, dtype=np.int32) % 50)).id == unused.id
    assert blobs[unused.id] <= set(jc.jobs.blobs.all_digests())


async def test_the_coordinator_prunes_unused_datasets_by_itself(start_jobs) -> None:
    jc = await start_jobs(nodes=0, dataset_ttl_s=0.2)
    info = await jc.upload(np.arange(3000, dtype=np.int32) % 50)
    await wait_until(
        lambda: jc.jobs.repo.dataset(info.id) is None, 10.0, "the unused dataset to go"
    )
    await wait_until(lambda: not list(jc.jobs.blobs.all_digests()), 10.0, "its blobs to go")


async def test_a_runner_downloads_the_jobs_dataset_once_and_then_reads_its_copy(
    jc: JobsCoordinator, tmp_path: Path
) -> None:
    tokens = (np.arange(SHARD_TOKENS + 5000) * 3) % 61
    info = await jc.upload(tokens)
    job = await jc.submit(info.id)
    async with AsyncClient(jc.coordinator.address, cache_dir=tmp_path / "cache") as client:
        seen: list[int] = []
        first = await client.job_dataset(job.job_id, lambda what, done, total: seen.append(done))
        assert np.array_equal(first.tokens, tokens) and isinstance(first.tokens, np.memmap)
        assert seen[-1] == len(tokens) * 4
        # The coordinator loses the shards: a resume still trains, from the runner's copy.
        for shard in info.shards:
            jc.jobs.blobs.delete(shard.sha256)
        again = await client.job_dataset(job.job_id)
        assert np.array_equal(again.tokens, tokens)
        sampler = BatchSampler(again, seq_len=16, batch_size=4, seed=1)
        inputs, labels = sampler.batch(3)
        assert np.array_equal(labels[:, :-1], inputs[:, 1:]) and inputs.max() < 61

    # Without that copy the runner says what went wrong, and keeps nothing half-written.
    async with AsyncClient(jc.coordinator.address, cache_dir=tmp_path / "other") as client:
        with pytest.raises(CoordinatorError) as caught:
            await client.job_dataset(job.job_id)
    assert caught.value.code == grpc.StatusCode.DATA_LOSS
    assert "upload the dataset again" in caught.value.details
    assert list((tmp_path / "other" / "datasets").iterdir()) == []
