"""The real coordinator (in-process, real gRPC on loopback, real SQLite) with its model store.

Tests reach the store through the coordinator's own servicers, so admin auth, delegation
and ticket checks by the real registry are all part of what they exercise. Nodes are
registered with real Ed25519 keys (support.coordinator_harness.FakeNode).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.checkpoints import make_checkpoint
from support.coordinator_harness import FakeNode, checks_commits, harness_settings

from coordinator.admin_auth import bearer_metadata
from coordinator.model_store import ModelStore, StoreLimits, open_checkpoint
from coordinator.server import RunningCoordinator, running_coordinator
from protos import codec
from protos.tessera.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    client_api_pb2,
    client_api_pb2_grpc,
    coordinator_pb2_grpc,
)

OPTIONS = [
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
]


@dataclass
class StoreServer:
    coordinator: RunningCoordinator
    channel: grpc.aio.Channel
    stack: contextlib.AsyncExitStack

    @property
    def address(self) -> str:
        return self.coordinator.address

    @property
    def data_dir(self) -> Path:
        return self.coordinator.ctx.data_dir

    @property
    def store(self) -> ModelStore:
        return self.coordinator.ctx.model_store

    @property
    def admin(self) -> admin_pb2_grpc.AdminStub:
        return admin_pb2_grpc.AdminStub(self.channel)

    @property
    def client_api(self) -> client_api_pb2_grpc.ClientApiStub:
        return client_api_pb2_grpc.ClientApiStub(self.channel)

    @property
    def coordinator_api(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(self.channel)

    @property
    def auth(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.coordinator.ctx.admin_token)

    async def register_node(self, name: str = "fetcher") -> FakeNode:
        """A node registered with a real key; `.node_id` and `.ticket` prove it on fetches."""
        node = FakeNode(self.channel, name)
        await node.register()
        return node

    async def add_model(
        self, messages: list[admin_pb2.AddModelChunk], metadata: Any = "admin"
    ) -> client_api_pb2.ModelInfo:
        """AddModel through the sync client, in a thread.

        The asyncio client may turn a status the server sends while the client is still
        streaming into INTERNAL "Internal error from Core" (grpc/grpc#36066); the sync client
        reports the server's status, which is what these tests check.
        """
        stub = admin_pb2_grpc.AdminStub(self.sync_channel)
        metadata = self.auth if metadata == "admin" else metadata
        return await asyncio.to_thread(stub.AddModel, iter(messages), metadata=metadata)

    @functools.cached_property
    def sync_channel(self) -> grpc.Channel:
        channel = grpc.insecure_channel(self.address, options=OPTIONS)
        self.stack.callback(channel.close)
        return channel

    def blob_files(self) -> list[Path]:
        return sorted(p for p in (self.data_dir / "blobs").rglob("*") if p.is_file())

    async def stop(self) -> None:
        await self.stack.aclose()


@pytest.fixture
async def server_factory(tmp_path: Path):
    """Start coordinators (own data dir, store limits, planner coverage); all stopped at the end."""
    started: list[StoreServer] = []

    async def start(
        data_dir: Path | None = None, limits: StoreLimits | None = None, coverage: Any = None
    ) -> StoreServer:
        stack = contextlib.AsyncExitStack()
        settings = harness_settings(data_dir or tmp_path / "coordinator")
        coordinator = await stack.enter_async_context(running_coordinator(settings))
        checks_commits(stack, coordinator)
        ctx = coordinator.ctx
        assert isinstance(ctx.model_store, ModelStore), "the server did not build the store"
        if limits is not None or coverage is not None:
            ctx.model_store = ModelStore(
                ctx.db,
                ctx.data_dir,
                limits=limits,
                coverage=coverage,
                check_ticket=ctx.registry.check_ticket,
            )
        channel = grpc.aio.insecure_channel(coordinator.address, options=OPTIONS)
        stack.push_async_callback(channel.close)
        served = StoreServer(coordinator, channel, stack)
        started.append(served)
        return served

    yield start
    for served in reversed(started):
        await served.stop()


@pytest.fixture
async def store_server(server_factory) -> StoreServer:
    return await server_factory()


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "tiny-llama", "llama", num_layers=3, tokenizer=True)


def _upload_chunks(
    directory: Path, name: str, *, replace: bool = False, chunk_bytes: int = 1000
) -> list[admin_pb2.AddModelChunk]:
    """The exact messages `models add` sends, as a list tests can tamper with."""
    checkpoint = open_checkpoint(directory)
    header = admin_pb2.AddModelHeader(
        name=name,
        config_json=checkpoint.config_json,
        tokenizer_json=checkpoint.tokenizer_json,
        replace=replace,
    )
    data = []
    for tensor in checkpoint.tensors:
        header.tensors.add(
            name=tensor.name,
            dtype=tensor.dtype,
            shape=list(tensor.shape),
            nbytes=tensor.nbytes,
            sha256=tensor.sha256(),
        )
        offset = 0
        for chunk in tensor.iter_bytes(chunk_bytes):
            data.append(
                admin_pb2.AddModelChunk(
                    data=admin_pb2.TensorData(name=tensor.name, offset=offset, data=chunk)
                )
            )
            offset += len(chunk)
    return [admin_pb2.AddModelChunk(header=header), *data]


@pytest.fixture
def upload_chunks():
    """upload_chunks(dir, name, replace=False, chunk_bytes=1000) -> list of AddModelChunk."""
    return _upload_chunks
