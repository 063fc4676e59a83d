"""Token datasets: received once as shards of int32 token ids, kept content-addressed.

A dataset is a stream of token ids, split into shards so that a huge one never needs to
sit in one message or one buffer. Its id is a sha256 over its shard list, so uploading the
same tokens again finds the stored copy (the client asks GetDataset first) and identical
shards of different datasets share one blob. The receiver trusts nothing: every shard's
bytes must arrive in order and exactly once, hash to the declared digest, and hold token
ids >= 0; the largest id is recorded so a job on a smaller vocabulary is refused up front.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np

from coordinator.jobs.blob_io import read_blob
from coordinator.jobs.limits import JobLimits
from coordinator.jobs.repository import DatasetRecord, ShardRecord
from coordinator.model_store.blob_store import BlobStore, BlobWriter, DigestMismatch, is_sha256_hex
from coordinator.model_store.errors import StoreError, invalid
from protos.datasets import TOKEN_BYTES, TOKEN_DTYPE, dataset_id
from protos.quoting import shown
from protos.tessera.v1 import jobs_pb2


def check_name(name: str, limits: JobLimits) -> None:
    if not name or len(name) > limits.max_name_chars or not name.isprintable():
        raise invalid(
            f"dataset name must be 1-{limits.max_name_chars} printable characters, "
            f"got {shown(name)}"
        )


def plan_dataset(header: jobs_pb2.DatasetHeader, limits: JobLimits) -> DatasetRecord:
    """Validate a header; the record lacks max_token_id until the bytes arrived."""
    check_name(header.name, limits)
    if not header.shards:
        raise invalid("the dataset header lists no shards; a dataset needs at least one token")
    if len(header.shards) > limits.max_dataset_shards:
        raise invalid(
            f"the dataset has {len(header.shards)} shards; at most {limits.max_dataset_shards} "
            "are allowed (use larger shards)"
        )
    shards = []
    for i, shard in enumerate(header.shards):
        if not is_sha256_hex(shard.sha256):
            raise invalid(
                f"shard {i}: sha256 must be 64 lowercase hex digits, got {shown(shard.sha256)}"
            )
        if shard.num_tokens == 0:
            raise invalid(f"shard {i} is empty; leave empty shards out")
        shards.append(ShardRecord(shard.sha256, shard.num_tokens))
    total_tokens = sum(s.num_tokens for s in shards)
    if total_tokens * TOKEN_BYTES > limits.max_dataset_bytes:
        raise StoreError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the dataset has {total_tokens} tokens ({total_tokens * TOKEN_BYTES} bytes), above "
            f"this coordinator's limit of {limits.max_dataset_bytes} bytes",
        )
    if header.example_len > limits.max_example_len:
        raise invalid(f"example_len {header.example_len} is above {limits.max_example_len}")
    if header.example_len and total_tokens % header.example_len:
        raise invalid(
            f"the dataset has {total_tokens} tokens, not a whole number of examples of "
            f"{header.example_len} tokens"
        )
    return DatasetRecord(
        id=dataset_id(((s.sha256, s.num_tokens) for s in shards), header.example_len),
        name=header.name,
        num_tokens=total_tokens,
        max_token_id=0,
        example_len=header.example_len,
        created_ms=int(time.time() * 1000),
        shards=tuple(shards),
    )


class DatasetReceiver:
    """Takes the data messages of one upload and turns them into verified blobs."""

    def __init__(self, plan: DatasetRecord, blobs: BlobStore) -> None:
        self._plan = plan
        self._blobs = blobs
        self._shard = 0
        self._received = 0
        self._writer: BlobWriter | None = None
        self._done: list[BlobWriter] = []
        self.max_token_id = 0

    async def accept(self, data: jobs_pb2.DatasetData) -> None:
        shards = self._plan.shards
        if self._shard >= len(shards):
            raise invalid(f"data for shard {data.shard} after every shard was complete")
        if data.shard != self._shard:
            raise invalid(
                f"data for shard {data.shard} while shard {self._shard} is incomplete "
                f"({self._received} of {shards[self._shard].num_tokens * TOKEN_BYTES} bytes); "
                "send the shards in order, each contiguously"
            )
        if data.offset != self._received:
            raise invalid(
                f"shard {data.shard}: chunk at offset {data.offset}, expected {self._received}"
            )
        size = shards[self._shard].num_tokens * TOKEN_BYTES
        if self._received + len(data.data) > size:
            raise invalid(f"shard {data.shard}: more bytes than the {size} its header declared")
        if len(data.data) % TOKEN_BYTES:
            raise invalid(
                f"shard {data.shard}: a chunk of {len(data.data)} bytes splits a token; send "
                f"whole int32 tokens ({TOKEN_BYTES} bytes each)"
            )
        if self._writer is None:
            self._writer = self._blobs.new_writer()
        tokens = np.frombuffer(data.data, dtype=TOKEN_DTYPE)
        if tokens.size:
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0:
                raise invalid(f"shard {data.shard} holds a negative token id ({low})")
            self.max_token_id = max(self.max_token_id, high)
            await asyncio.to_thread(self._writer.write, data.data)
            self._received += len(data.data)
        if self._received == size:
            await self._finish()

    async def _finish(self) -> None:
        writer = self._writer
        assert writer is not None
        shard = self._plan.shards[self._shard]
        try:
            await asyncio.to_thread(writer.finish, shard.sha256)
        except DigestMismatch as err:
            raise invalid(
                f"shard {self._shard}: the received bytes have sha256 {err.actual}, but the "
                f"header declared {err.expected}; the upload is corrupt"
            ) from None
        self._done.append(writer)
        self._writer = None
        self._shard += 1
        self._received = 0

    def complete(self) -> list[BlobWriter]:
        if self._shard < len(self._plan.shards):
            raise invalid(
                f"the stream ended after {self._shard} of {len(self._plan.shards)} shards; "
                "nothing was stored"
            )
        return self._done

    def discard(self) -> None:
        if self._writer is not None:
            self._writer.discard()
        for writer in self._done:
            writer.discard()


async def stream_dataset(
    record: DatasetRecord, blobs: BlobStore, chunk_bytes: int
) -> AsyncIterator[jobs_pb2.DatasetChunk]:
    yield jobs_pb2.DatasetChunk(header=to_header(record))
    for index, shard in enumerate(record.shards):
        offset = 0
        async for data in read_blob(blobs, shard.sha256, chunk_bytes):
            yield jobs_pb2.DatasetChunk(
                data=jobs_pb2.DatasetData(shard=index, offset=offset, data=data)
            )
            offset += len(data)


def to_header(record: DatasetRecord) -> jobs_pb2.DatasetHeader:
    return jobs_pb2.DatasetHeader(
        name=record.name,
        shards=[
            jobs_pb2.DatasetShard(sha256=s.sha256, num_tokens=s.num_tokens) for s in record.shards
        ],
        example_len=record.example_len,
    )


def to_info(record: DatasetRecord) -> jobs_pb2.DatasetInfo:
    return jobs_pb2.DatasetInfo(
        id=record.id,
        name=record.name,
        num_tokens=record.num_tokens,
        max_token_id=record.max_token_id,
        example_len=record.example_len,
        shards=to_header(record).shards,
        created_unix_ms=record.created_ms,
    )
