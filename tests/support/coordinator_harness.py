"""Test helpers for the coordinator: a real in-process grpc.aio coordinator on 127.0.0.1
(`Harness`) and fake nodes that speak the real protocol with their own Ed25519 keys.

    from support.coordinator_harness import FakeNode, wait_until
    node = FakeNode(channel, "n1"); await node.register(); await node.attach()
    await node.heartbeat(1)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from coordinator.node_state import NodeState
from coordinator.server import RunningCoordinator
from coordinator.settings import Settings
from protos import codec, identity
from protos.tessera.v1 import (
    admin_pb2_grpc,
    client_api_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
    node_pb2,
)

GIB = 1 << 30

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    # Twice the limit, so a test can send an oversized message and see the server refuse it.
    ("grpc.max_send_message_length", 2 * codec.MAX_MESSAGE_BYTES),
    # As protos/dialing.py: a channel left over from an earlier test, to a server that had
    # the same (recycled) port, must not lend its reconnect backoff to this one.
    ("grpc.use_local_subchannel_pool", 1),
]


def good_capabilities(**overrides: Any) -> node_pb2.Capabilities:
    caps = node_pb2.Capabilities(
        device_kind="cuda",
        device_name="NVIDIA GeForce RTX 3090",
        device_count=1,
        memory_total_bytes=24 * GIB,
        memory_usable_bytes=22 * GIB,
        compute_capability="8.6",
        cpu_cores=16,
        ram_bytes=64 * GIB,
        matmul_tflops=35.5,
        region="eu-west",
        price_per_1k_token_layers=0.01,
        limits=node_pb2.OwnerLimits(max_sessions=8, active_hours="22:00-07:00"),
        agent_version="0.1.0",
        dtypes=["float32", "float16", "bfloat16"],
    )
    for key, value in overrides.items():
        if isinstance(value, list):
            del getattr(caps, key)[:]
            getattr(caps, key).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(caps, key).CopyFrom(value)
        else:
            setattr(caps, key, value)
    return caps


class FakeNode:
    """A node agent reduced to the protocol: register, attach, heartbeat."""

    def __init__(self, channel: grpc.aio.Channel, name: str = "test-node") -> None:
        self.stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self.key = identity.generate_private_key()
        self.public_key = identity.public_key_bytes(self.key)
        self.name = name
        self.node_id = identity.node_id(self.public_key)
        self.ticket = b""
        self.call: Any = None

    async def challenge(self) -> bytes:
        reply = await self.stub.GetChallenge(
            coordinator_pb2.ChallengeRequest(public_key=self.public_key)
        )
        return reply.nonce

    def request(self, nonce: bytes, sign: bool = True, **fields: Any) -> Any:
        fields.setdefault("name", self.name)
        fields.setdefault("account", "alice")
        fields.setdefault("capabilities", good_capabilities())
        request = coordinator_pb2.RegisterRequest(public_key=self.public_key, nonce=nonce, **fields)
        if sign:
            identity.sign_register(self.key, request)
        return request

    async def register(self, **fields: Any) -> coordinator_pb2.RegisterResponse:
        reply = await self.stub.Register(self.request(await self.challenge(), **fields))
        assert reply.node_id == self.node_id
        self.ticket = reply.attach_ticket
        return reply

    async def attach(self) -> Any:
        """Open an Attach stream, say hello, and return the call after the welcome."""
        call = self.stub.Attach()
        await call.write(
            coordinator_pb2.NodeMessage(
                hello=coordinator_pb2.AttachHello(node_id=self.node_id, attach_ticket=self.ticket)
            )
        )
        welcome = await call.read()
        assert welcome.WhichOneof("kind") == "welcome", welcome
        self.call = call
        return call

    async def heartbeat(
        self, seq: int, telemetry: node_pb2.Telemetry | None = None, call: Any = None
    ) -> coordinator_pb2.CoordinatorMessage:
        call = call or self.call
        beat = coordinator_pb2.Heartbeat(seq=seq, sent_unix_ms=int(time.time() * 1000))
        if telemetry is not None:
            beat.telemetry.CopyFrom(telemetry)
        await call.write(coordinator_pb2.NodeMessage(heartbeat=beat))
        return await call.read()


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0, what: str = ""
) -> None:
    """Poll `predicate` until true; fail after `timeout` s (a deadline, not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        await asyncio.sleep(0.01)


def checks_commits(stack: contextlib.AsyncExitStack, coordinator: RunningCoordinator) -> None:
    """When the test ends, before the coordinator stops: no transaction is open. Every
    write commits in one of its own; a bare write opens one that nothing commits, and no
    later write reaches the file either (another connection sees none of them)."""

    def committed() -> None:
        assert not coordinator.ctx.db.conn.in_transaction, (
            "the coordinator left a database transaction open: some write ran outside one"
        )

    stack.callback(committed)


def state_of(coordinator: RunningCoordinator, node_id: str) -> NodeState | None:
    view = coordinator.ctx.registry.node(node_id)
    return None if view is None else view.state


class Harness:
    """One in-process coordinator plus a client channel to it."""

    def __init__(self, coordinator: RunningCoordinator, channel: grpc.aio.Channel) -> None:
        self.coordinator = coordinator
        self.channel = channel
        self.registry = coordinator.ctx.registry
        self.coordinator_stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self.client_api = client_api_pb2_grpc.ClientApiStub(channel)
        self.admin = admin_pb2_grpc.AdminStub(channel)

    @property
    def ctx(self) -> Any:
        return self.coordinator.ctx

    def node(self, name: str = "test-node") -> FakeNode:
        return FakeNode(self.channel, name)

    async def registered_node(self, name: str = "test-node", attach: bool = False) -> FakeNode:
        node = self.node(name)
        await node.register()
        if attach:
            await node.attach()
        return node

    def state(self, node_id: str) -> NodeState | None:
        return state_of(self.coordinator, node_id)

    async def wait_state(self, node_id: str, state: NodeState, timeout: float = 5.0) -> None:
        await wait_until(
            lambda: self.state(node_id) is state, timeout, f"node {node_id} to be {state.value}"
        )


def harness_settings(tmp_path: Path, **overrides: Any) -> Settings:
    base = Settings(
        db_path=tmp_path / "coordinator.db",
        data_dir=tmp_path,
        listen="127.0.0.1:0",
        heartbeat_interval_s=60.0,  # long: tests that want silence to matter shorten it
        flush_interval_s=0.05,
        shutdown_grace_s=1.0,
    )
    return replace(base, **overrides)
