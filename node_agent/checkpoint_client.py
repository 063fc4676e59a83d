"""Streams a training stage's state to and from the coordinator's ``TrainingStore``.

The node authenticates like the shard fetcher does (``x-tessera-node-id`` and the attach
ticket of its current registration as ``x-tessera-ticket``). Uploads are cut into chunks
well below the gRPC message limit; the first chunk carries the header with the total size
and the sha256 of the whole state, which the coordinator checks before it records the
checkpoint. Downloads are checked here the same way: contiguous offsets, the announced
size (never more than the caller's limit), and the sha256 the caller expects.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from node_agent.context import AgentContext
from node_agent.shard_fetcher import NODE_ID_METADATA, TICKET_METADATA
from protos import dialing
from protos.tessera.v1 import common_pb2, training_pb2, training_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK_BYTES = 1 << 20
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# A coordinator that is down or restarting: the transfer is tried again for this long
# (well within the driver's call timeout) before the driver hears of it.
UPSTREAM_PATIENCE_S = 60.0
# A restarted coordinator knows no ticket until the agent registers again: a refusal of
# the ticket waits this long for a new one.
NEW_TICKET_WAIT_S = 15.0


class CheckpointTransferError(Exception):
    """An upload or download failed; ``code`` is the status to answer the driver with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class CheckpointRef:
    job_id: str
    step: int
    start: int
    end: int

    def describe(self) -> str:
        return f"job {self.job_id!r} step {self.step} layers [{self.start}, {self.end})"

    def layers(self) -> common_pb2.LayerRange:
        return common_pb2.LayerRange(start=self.start, end=self.end)


class CheckpointClient:
    """One short-lived channel per transfer: the coordinator address and ticket change
    whenever the agent registers again, so they are read from the context each time."""

    def __init__(self, ctx: AgentContext, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._ctx = ctx
        self._chunk_bytes = chunk_bytes

    async def upload(self, ref: CheckpointRef, data: bytes) -> training_pb2.CheckpointReceipt:
        # Hashing gigabytes takes seconds: not on the event loop.
        digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        header = training_pb2.CheckpointHeader(
            job_id=ref.job_id,
            step=ref.step,
            layers=ref.layers(),
            total_bytes=len(data),
            sha256=digest,
        )

        async def chunks() -> AsyncIterator[training_pb2.CheckpointChunk]:
            view = memoryview(data)
            for offset in range(0, max(1, len(data)), self._chunk_bytes):
                piece = bytes(view[offset : offset + self._chunk_bytes])
                chunk = training_pb2.CheckpointChunk(offset=offset, data=piece)
                if offset == 0:
                    chunk.header.CopyFrom(header)
                yield chunk

        async def attempt() -> training_pb2.CheckpointReceipt:
            async with self._channel() as stub:
                return await stub.UploadCheckpoint(chunks(), metadata=self._metadata())

        receipt = await self._patiently("upload", ref, attempt)
        if receipt.sha256 != digest or receipt.total_bytes != len(data):
            raise CheckpointTransferError(
                grpc.StatusCode.DATA_LOSS,
                f"the coordinator stored {receipt.total_bytes} bytes hashing to "
                f"{receipt.sha256[:12]}... for {ref.describe()}, but this node sent "
                f"{len(data)} bytes hashing to {digest[:12]}...; save the checkpoint again",
            )
        return receipt

    async def download(self, ref: CheckpointRef, expected_sha256: str, max_bytes: int) -> bytes:
        request = training_pb2.DownloadCheckpointRequest(
            job_id=ref.job_id, step=ref.step, layers=ref.layers()
        )

        async def attempt() -> bytes:
            async with self._channel() as stub:
                return await self._receive(
                    stub.DownloadCheckpoint(request, metadata=self._metadata()),
                    ref,
                    expected_sha256,
                    max_bytes,
                )

        return await self._patiently("download", ref, attempt)

    # ---- internals --------------------------------------------------------------------

    async def _patiently(
        self, what: str, ref: CheckpointRef, attempt: Callable[[], Awaitable[T]]
    ) -> T:
        """Run ``attempt``, again while the coordinator cannot be reached (up to
        UPSTREAM_PATIENCE_S) and once the agent has a new ticket after a refusal of its old
        one (a restarted coordinator), so that a coordinator restart does not fail a
        training stage that is healthy."""
        began = time.monotonic()
        delay = 0.5
        while True:
            ticket = self._ctx.attach_ticket
            try:
                return await attempt()
            except grpc.aio.AioRpcError as err:
                code = err.code()
                failure = self._failed(what, ref, err)
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    if not await self._new_ticket(ticket):
                        raise failure from err
                elif code not in UNREACHABLE or time.monotonic() - began > UPSTREAM_PATIENCE_S:
                    raise failure from err
                else:
                    log.warning("%s; trying again in %.1fs", failure.message, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

    async def _new_ticket(self, refused: bytes) -> bool:
        """Wait (up to NEW_TICKET_WAIT_S) for the agent to register again with a ticket
        other than ``refused``."""
        deadline = time.monotonic() + NEW_TICKET_WAIT_S
        while self._ctx.attach_ticket == refused:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)
        return True

    async def _receive(
        self,
        stream: AsyncIterator[training_pb2.CheckpointChunk],
        ref: CheckpointRef,
        expected_sha256: str,
        max_bytes: int,
    ) -> bytes:
        header: training_pb2.CheckpointHeader | None = None
        buffer = bytearray()
        hasher = hashlib.sha256()
        async for chunk in stream:
            if header is None:
                if not chunk.HasField("header"):
                    raise _bad_stream(ref, "its first chunk carries no header")
                header = chunk.header
                _check_header(header, ref, expected_sha256, max_bytes)
            if chunk.offset != len(buffer):
                raise _bad_stream(ref, f"chunk at offset {chunk.offset}, expected {len(buffer)}")
            if len(buffer) + len(chunk.data) > header.total_bytes:
                raise _bad_stream(ref, f"more than the announced {header.total_bytes} bytes")
            buffer += chunk.data
            hasher.update(chunk.data)
        if header is None:
            raise _bad_stream(ref, "it was empty")
        if len(buffer) != header.total_bytes:
            raise _bad_stream(ref, f"{len(buffer)} of the announced {header.total_bytes} bytes")
        if hasher.hexdigest() != expected_sha256:
            raise CheckpointTransferError(
                grpc.StatusCode.DATA_LOSS,
                f"the downloaded checkpoint of {ref.describe()} hashes to "
                f"{hasher.hexdigest()[:12]}..., not the expected {expected_sha256[:12]}...; "
                "the coordinator's copy is corrupt: restore an earlier consistent checkpoint",
            )
        return bytes(buffer)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (
            (NODE_ID_METADATA, self._ctx.node_id),
            (TICKET_METADATA, self._ctx.attach_ticket.hex()),
        )

    def _channel(self) -> _StoreChannel:
        return _StoreChannel(self._ctx)

    def _failed(
        self, what: str, ref: CheckpointRef, err: grpc.aio.AioRpcError
    ) -> CheckpointTransferError:
        code = err.code()
        if code in UNREACHABLE:
            return CheckpointTransferError(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot {what} the checkpoint of {ref.describe()}: the coordinator at "
                f"{self._ctx.coordinator_address} is unreachable ({err.details()}); retry "
                "once it is back",
            )
        return CheckpointTransferError(
            code,
            f"the coordinator refused the {what} of the checkpoint of {ref.describe()}: "
            f"{err.details()}",
        )


class _StoreChannel:
    def __init__(self, ctx: AgentContext) -> None:
        self._channel = dialing.aio_channel(ctx.coordinator_address, ctx.channel_options)

    async def __aenter__(self) -> training_pb2_grpc.TrainingStoreStub:
        return training_pb2_grpc.TrainingStoreStub(self._channel)

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close()


def _check_header(
    header: training_pb2.CheckpointHeader,
    ref: CheckpointRef,
    expected_sha256: str,
    max_bytes: int,
) -> None:
    got = CheckpointRef(header.job_id, header.step, header.layers.start, header.layers.end)
    if got != ref:
        raise _bad_stream(ref, f"it holds {got.describe()} instead")
    if header.total_bytes > max_bytes:
        raise CheckpointTransferError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the checkpoint of {ref.describe()} is {header.total_bytes} bytes, more than the "
            f"{max_bytes} this stage's state can take; it belongs to another model or mode",
        )
    if header.sha256 != expected_sha256:
        raise CheckpointTransferError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the coordinator holds a checkpoint of {ref.describe()} with sha256 "
            f"{header.sha256[:12]}..., but the driver asked for {expected_sha256[:12]}...; "
            "ask the coordinator for the job's last consistent checkpoint again",
        )


def _bad_stream(ref: CheckpointRef, why: str) -> CheckpointTransferError:
    return CheckpointTransferError(
        grpc.StatusCode.DATA_LOSS,
        f"the coordinator's download of {ref.describe()} is malformed: {why}",
    )
