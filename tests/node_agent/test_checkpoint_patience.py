"""A node's checkpoint transfers ride out a coordinator restart.

The node's ``CheckpointClient`` talks to a real gRPC server on loopback that plays the
coordinator's ``TrainingStore``: it checks the node's ticket like the real one (which is
tested in tests/training/test_coordinator_store.py) and can be down, or know only a newer
ticket, as a coordinator that restarted does until the agent registers again. A refusal
that a restart does not explain fails at once, so the driver hears of a real fault.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from data_plane.stage_harness import node_context
from support.ports import free_port

from node_agent import checkpoint_client
from node_agent.checkpoint_client import CheckpointClient, CheckpointRef, CheckpointTransferError
from node_agent.context import AgentContext
from node_agent.shard_fetcher import TICKET_METADATA
from protos.tessera.v1 import training_pb2, training_pb2_grpc

REF = CheckpointRef("job-1", 2, 0, 3)
STATE = bytes(range(256)) * 40  # 10 KiB of optimizer state, in 3 chunks of 4 KiB
OLD, NEW = b"old-ticket", b"new-ticket"


class Store(training_pb2_grpc.TrainingStoreServicer):
    """Keeps what was uploaded; ``refuse`` makes every call fail with that status."""

    def __init__(self, ticket: bytes) -> None:
        self.ticket = ticket
        self.refuse: grpc.StatusCode | None = None
        self.calls = 0
        self.stored = b""

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        self.calls += 1
        if self.refuse is not None:
            await context.abort(self.refuse, "refused by the test")
        metadata = dict(context.invocation_metadata() or ())
        if metadata.get(TICKET_METADATA) != self.ticket.hex():
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown ticket; register again")

    async def UploadCheckpoint(self, request_iterator, context):  # noqa: N802
        await self._admit(context)
        data = b"".join([chunk.data async for chunk in request_iterator])
        self.stored = data
        return training_pb2.CheckpointReceipt(
            sha256=hashlib.sha256(data).hexdigest(), total_bytes=len(data), consistent=True
        )

    async def DownloadCheckpoint(self, request, context):  # noqa: N802
        await self._admit(context)
        header = training_pb2.CheckpointHeader(
            job_id=request.job_id,
            step=request.step,
            layers=request.layers,
            total_bytes=len(self.stored),
            sha256=hashlib.sha256(self.stored).hexdigest(),
        )
        yield training_pb2.CheckpointChunk(header=header, offset=0, data=self.stored)


class Coordinator:
    """The store on a fixed port, started and stopped as a coordinator process would be."""

    def __init__(self, store: Store, port: int) -> None:
        self.store, self.port = store, port
        self.server: grpc.aio.Server | None = None

    async def start(self, after_s: float = 0.0) -> None:
        await asyncio.sleep(after_s)
        self.server = grpc.aio.server()
        training_pb2_grpc.add_TrainingStoreServicer_to_server(self.store, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[AgentContext, Coordinator]]:
    port = free_port()
    ctx = node_context(tmp_path, b"")
    ctx.coordinator_address, ctx.attach_ticket = f"127.0.0.1:{port}", OLD
    coordinator = Coordinator(Store(OLD), port)
    yield ctx, coordinator
    await coordinator.stop()


async def test_an_upload_waits_for_a_coordinator_that_is_down_then_a_download_finds_it(
    setup,
) -> None:
    ctx, coordinator = setup
    client = CheckpointClient(ctx, chunk_bytes=4096)
    started = time.monotonic()
    coming_back = asyncio.ensure_future(coordinator.start(after_s=1.0))
    receipt = await client.upload(REF, STATE)
    await coming_back
    assert time.monotonic() - started >= 1.0  # it waited, and then it went through
    assert receipt.sha256 == hashlib.sha256(STATE).hexdigest()
    assert coordinator.store.stored == STATE and coordinator.store.calls == 1
    # Down again, and back: the restore waits the same way.
    await coordinator.stop()
    coming_back = asyncio.ensure_future(coordinator.start(after_s=0.5))
    assert await client.download(REF, receipt.sha256, len(STATE)) == STATE
    await coming_back


async def test_a_restarted_coordinator_takes_the_upload_once_the_node_registered_again(
    setup,
) -> None:
    ctx, coordinator = setup
    coordinator.store.ticket = NEW  # it restarted: only the next registration's ticket
    await coordinator.start()

    async def register_again() -> None:
        await asyncio.sleep(0.5)
        ctx.attach_ticket = NEW

    registering = asyncio.ensure_future(register_again())
    receipt = await CheckpointClient(ctx).upload(REF, STATE)
    await registering
    assert receipt.total_bytes == len(STATE) and coordinator.store.stored == STATE
    assert coordinator.store.calls == 2  # refused with the old ticket, taken with the new


async def test_a_ticket_refused_with_no_new_registration_fails_after_a_bounded_wait(
    setup, monkeypatch
) -> None:
    monkeypatch.setattr(checkpoint_client, "NEW_TICKET_WAIT_S", 0.5)
    ctx, coordinator = setup
    coordinator.store.ticket = NEW
    await coordinator.start()
    started = time.monotonic()
    with pytest.raises(CheckpointTransferError) as err:
        await CheckpointClient(ctx).upload(REF, STATE)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert 0.5 <= time.monotonic() - started < 5.0
    assert coordinator.store.calls == 1 and not coordinator.store.stored


async def test_a_refusal_a_restart_does_not_explain_fails_at_once(setup) -> None:
    ctx, coordinator = setup
    coordinator.store.refuse = grpc.StatusCode.FAILED_PRECONDITION
    await coordinator.start()
    started = time.monotonic()
    with pytest.raises(CheckpointTransferError) as err:
        await CheckpointClient(ctx).upload(REF, STATE)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "refused by the test" in err.value.message
    assert time.monotonic() - started < 2.0 and coordinator.store.calls == 1


async def test_a_coordinator_down_for_longer_than_the_patience_fails_the_upload(
    setup, monkeypatch
) -> None:
    monkeypatch.setattr(checkpoint_client, "UPSTREAM_PATIENCE_S", 1.0)
    ctx, _ = setup
    started = time.monotonic()
    with pytest.raises(CheckpointTransferError) as err:
        await CheckpointClient(ctx).upload(REF, STATE)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "unreachable" in err.value.message and "retry once it is back" in err.value.message
    assert 1.0 <= time.monotonic() - started < 10.0
