"""Fixtures for the node agent's tests: an agent context, and a scripted coordinator.

The scripted coordinator is a real gRPC server on 127.0.0.1 that checks signatures like
the real one, but lets a test decide what it answers and see every message the node
sends. It covers what the real coordinator cannot be made to do on cue (refuse a node,
break a stream mid-way, send assign/drop); test_agent_e2e.py runs the real one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from node_agent import hardware_probe, identity
from node_agent.agent import CHANNEL_OPTIONS
from node_agent.context import AgentContext
from node_agent.telemetry import ProcessTelemetry
from protos import identity as wire_identity
from protos.tessera.v1 import coordinator_pb2, coordinator_pb2_grpc, node_pb2

# Subprocess agents in these tests reconnect within a fraction of a second.
FAST_BACKOFF_ENV = {"TESSERA_BACKOFF_BASE_S": "0.05", "TESSERA_BACKOFF_CAP_S": "0.5"}


@pytest.fixture
def agent_ctx(tmp_path: Path) -> AgentContext:
    key = identity.load_or_create_key(tmp_path / "node")
    return AgentContext(
        node_id=wire_identity.node_id(wire_identity.public_key_bytes(key)),
        private_key=key,
        data_dir=tmp_path / "node",
        hardware=hardware_probe.probe("cpu"),
        coordinator_address="127.0.0.1:1",
        channel_options=list(CHANNEL_OPTIONS),
        telemetry_sources=[ProcessTelemetry("cpu")],  # as the CLI sets it up
    )


class ScriptedCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Records what nodes send; answers as `register_error` / `to_send` / `ack_state` say."""

    def __init__(self) -> None:
        self.address = ""
        self.public_key = os.urandom(32)
        self.registrations: list[coordinator_pb2.RegisterRequest] = []
        self.received: list[coordinator_pb2.NodeMessage] = []
        self.attaches = 0
        self.stream_ends: list[str] = []  # "eof" (node half-closed) or "cancelled"
        self.register_error: tuple[grpc.StatusCode, str] | None = None
        self.ack_state = node_pb2.NODE_STATE_ONLINE
        self.heartbeat_interval_ms = 100
        self.to_send: asyncio.Queue[coordinator_pb2.CoordinatorMessage] = asyncio.Queue()
        self.break_stream = asyncio.Event()  # set: abort the current Attach with UNAVAILABLE
        self._nonces: set[bytes] = set()
        self._tickets: dict[str, bytes] = {}

    async def GetChallenge(self, request, context):  # noqa: N802
        nonce = os.urandom(32)
        self._nonces.add(nonce)
        return coordinator_pb2.Challenge(nonce=nonce)

    async def Register(self, request, context):  # noqa: N802
        if request.nonce not in self._nonces or not wire_identity.verify(
            request.public_key, request.signature, wire_identity.register_payload(request)
        ):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad signature or nonce")
        self._nonces.discard(request.nonce)
        self.registrations.append(request)
        if self.register_error is not None:
            await context.abort(*self.register_error)
        node_id = wire_identity.node_id(request.public_key)
        self._tickets[node_id] = os.urandom(16)
        return coordinator_pb2.RegisterResponse(
            node_id=node_id,
            coordinator_public_key=self.public_key,
            attach_ticket=self._tickets[node_id],
            heartbeat_interval_ms=self.heartbeat_interval_ms,
            offline_after_ms=3 * self.heartbeat_interval_ms,
            reachable=True,
        )

    async def Attach(self, request_iterator, context):  # noqa: N802
        self.attaches += 1
        self.break_stream.clear()
        requests = aiter(request_iterator)
        hello = await anext(requests)
        if self._tickets.get(hello.hello.node_id) != hello.hello.attach_ticket:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong ticket")
        await context.write(
            coordinator_pb2.CoordinatorMessage(
                welcome=coordinator_pb2.Welcome(
                    node_id=hello.hello.node_id,
                    state=node_pb2.NODE_STATE_ONLINE,
                    heartbeat_interval_ms=self.heartbeat_interval_ms,
                )
            )
        )
        reader = asyncio.ensure_future(anext(requests, None))
        sender = asyncio.ensure_future(self.to_send.get())
        breaker = asyncio.ensure_future(self.break_stream.wait())
        try:
            while True:
                done, _ = await asyncio.wait(
                    {reader, sender, breaker}, return_when=asyncio.FIRST_COMPLETED
                )
                if breaker in done:
                    self.stream_ends.append("broken")
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted break")
                if sender in done:
                    await context.write(sender.result())
                    sender = asyncio.ensure_future(self.to_send.get())
                if reader in done:
                    message = reader.result()
                    if message is None:
                        self.stream_ends.append("eof")
                        return
                    self.received.append(message)
                    if message.HasField("drain"):
                        self.ack_state = node_pb2.NODE_STATE_DRAINING
                    if message.HasField("heartbeat"):
                        await context.write(
                            coordinator_pb2.CoordinatorMessage(
                                heartbeat_ack=coordinator_pb2.HeartbeatAck(
                                    seq=message.heartbeat.seq, state=self.ack_state
                                )
                            )
                        )
                    reader = asyncio.ensure_future(anext(requests, None))
        finally:
            for task in (reader, sender, breaker):
                task.cancel()

    def of_kind(self, kind: str) -> list:
        return [m for m in self.received if m.WhichOneof("kind") == kind]


async def _wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; fail with `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def scripted_coordinator() -> AsyncIterator[ScriptedCoordinator]:
    servicer = ScriptedCoordinator()
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    servicer.address = f"127.0.0.1:{port}"
    try:
        yield servicer
    finally:
        await server.stop(grace=None)


@pytest.fixture
def wait_until():
    """`await wait_until(predicate, timeout, what)`: poll with a deadline, never a bare sleep."""
    return _wait_until
