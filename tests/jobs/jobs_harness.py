"""A real in-process coordinator with a tiny model placed on fake stage nodes.

The nodes speak the real control protocol (Ed25519 registration, Attach stream) and answer
every AssignShard with READY, so placement, routing, sessions and jobs run for real; only
the data plane is absent (these tests exercise the coordinator's side of training).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from support.checkpoints import make_checkpoint
from support.coordinator_harness import (
    CHANNEL_OPTIONS,
    FakeNode,
    checks_commits,
    good_capabilities,
    harness_settings,
    wait_until,
)

from client.datasets import TokenDataset, upload_messages
from coordinator.jobs.limits import JobLimits
from coordinator.jobs.service import Jobs
from coordinator.model_store import open_checkpoint
from coordinator.planner import Shard
from coordinator.server import RunningCoordinator, running_coordinator
from protos.tessera.v1 import (
    admin_pb2,
    common_pb2,
    coordinator_pb2,
    jobs_pb2,
    jobs_pb2_grpc,
    node_pb2,
    training_pb2,
    training_pb2_grpc,
)

MODEL = "tiny"
NUM_LAYERS = 3


class StageNode(FakeNode):
    """A fake node that reports READY for every shard it is assigned."""

    def __init__(self, channel: grpc.aio.Channel, name: str) -> None:
        super().__init__(channel, name)
        self.shards: dict[str, tuple[int, int]] = {}
        self._task: asyncio.Task[None] | None = None

    async def join(self, **register_fields: Any) -> None:
        await self.register(**register_fields)
        await self.attach()
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    return
                if message.WhichOneof("kind") != "command":
                    continue
                command = message.command
                if command.WhichOneof("kind") == "assign":
                    assign = command.assign
                    self.shards[assign.model] = (assign.layers.start, assign.layers.end)
                    status = node_pb2.ShardStatus(
                        model=assign.model, layers=assign.layers,
                        state=node_pb2.SHARD_STATE_READY, progress=1.0,
                    )  # fmt: skip
                    await self.call.write(coordinator_pb2.NodeMessage(shard_status=status))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-tessera-node-id", self.node_id), ("x-tessera-ticket", self.ticket.hex()))

    async def leave(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.call is not None:
            self.call.cancel()


@dataclass
class JobsCoordinator:
    coordinator: RunningCoordinator
    channel: grpc.aio.Channel
    nodes: list[StageNode] = field(default_factory=list)

    @property
    def jobs(self) -> Jobs:
        return self.coordinator.ctx.jobs

    @property
    def stub(self) -> jobs_pb2_grpc.JobsStub:
        return jobs_pb2_grpc.JobsStub(self.channel)

    @property
    def store_stub(self) -> training_pb2_grpc.TrainingStoreStub:
        return training_pb2_grpc.TrainingStoreStub(self.channel)

    def node(self, node_id: str) -> StageNode:
        return next(n for n in self.nodes if n.node_id == node_id)

    def set_limits(self, limits: JobLimits) -> None:
        self.jobs.limits = limits
        self.jobs.manager.limits = limits

    async def add_node(self, name: str, account: str = "alice", **capabilities: Any) -> StageNode:
        """A node of operator ``account`` (all of one operator by default)."""
        node = StageNode(self.channel, name)
        await node.join(account=account, capabilities=good_capabilities(**capabilities))
        self.nodes.append(node)
        return node

    async def upload(self, tokens: np.ndarray, example_len: int = 0) -> jobs_pb2.DatasetInfo:
        dataset = TokenDataset("d", np.asarray(tokens, dtype=np.int32), example_len)
        return await self.stub.UploadDataset(aiter_of(list(upload_messages(dataset))))

    async def submit(self, dataset_id: str, **overrides: Any) -> jobs_pb2.JobInfo:
        return await self.stub.SubmitJob(submit_request(dataset_id, **overrides))

    async def ready(self, replicas: int = 1) -> None:
        placement = self.coordinator.ctx.planner

        async def covered() -> bool:
            # READY holders only: coverage also counts shards still being confirmed, and a
            # job's first layout picks among READY holders (one node per stage). And only
            # once the plan has settled: while the nodes join one by one, the plans made for
            # fewer nodes cut the model into fewer, wider stages, and a job opened while
            # such a shard is still READY may lay its stages out over it.
            await placement.settled()
            plan = placement.plan_of(MODEL)
            holders = placement.ready_holders(MODEL)
            if plan is None or any(
                plan.holders.get(h.node_id) != Shard(MODEL, h.start, h.end) for h in holders
            ):
                return False
            counts = [0] * NUM_LAYERS
            for holder in holders:
                for layer in range(holder.start, min(holder.end, NUM_LAYERS)):
                    counts[layer] += 1
            return min(counts) >= replicas

        await wait_until(covered, 10.0, f"{replicas} ready replica(s) of every layer")

    async def all_ready(self) -> None:
        """Every node's shard is READY (coverage counts shards still being confirmed)."""
        placement = self.coordinator.ctx.planner
        await wait_until(
            lambda: len(placement.ready_holders(MODEL)) >= len(self.nodes),
            10.0,
            "every node's shard to be ready",
        )


def hyper(**overrides: Any) -> training_pb2.TrainingHyper:
    values: dict[str, Any] = dict(
        mode="full", lora_rank=4, lora_alpha=8.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.0, max_grad_norm=1.0, seed=7, micro_batches=2,
    )  # fmt: skip
    values.update(overrides)
    return training_pb2.TrainingHyper(**values)


def submit_request(dataset_id: str, **overrides: Any) -> jobs_pb2.SubmitJobRequest:
    values: dict[str, Any] = dict(
        model=MODEL, dataset_id=dataset_id, hyper=hyper(), steps=6, batch_size=4, seq_len=8,
        checkpoint_every=2,
    )  # fmt: skip
    values.update(overrides)
    return jobs_pb2.SubmitJobRequest(**values)


async def aiter_of(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def model_messages(directory: Path, name: str) -> list[admin_pb2.AddModelChunk]:
    checkpoint = open_checkpoint(directory)
    header = admin_pb2.AddModelHeader(
        name=name, config_json=checkpoint.config_json, tokenizer_json=checkpoint.tokenizer_json
    )
    data = []
    for tensor in checkpoint.tensors:
        header.tensors.add(
            name=tensor.name, dtype=tensor.dtype, shape=list(tensor.shape),
            nbytes=tensor.nbytes, sha256=tensor.sha256(),
        )  # fmt: skip
        data.append(
            admin_pb2.AddModelChunk(
                data=admin_pb2.TensorData(name=tensor.name, data=b"".join(tensor.iter_bytes()))
            )
        )
    return [admin_pb2.AddModelChunk(header=header), *data]


def layers(start: int, end: int) -> common_pb2.LayerRange:
    return common_pb2.LayerRange(start=start, end=end)


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "tiny", "llama", num_layers=NUM_LAYERS, tokenizer=True)


@pytest.fixture
async def start_jobs(
    tmp_path: Path, tiny_model: Path
) -> AsyncIterator[Callable[..., Awaitable[JobsCoordinator]]]:
    """start_jobs(nodes=6, accounts=None, **settings) -> a coordinator with MODEL placed on
    `nodes` nodes (of operator accounts[i], else all of one operator)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(
            nodes: int = 6, accounts: list[str] | None = None, **overrides: Any
        ) -> JobsCoordinator:
            overrides.setdefault("min_stages", NUM_LAYERS)
            overrides.setdefault("replicas", 2)
            overrides.setdefault("kv_tokens_per_shard", 64)
            settings = harness_settings(tmp_path / "coordinator", **overrides)
            coordinator = await stack.enter_async_context(running_coordinator(settings))
            checks_commits(stack, coordinator)
            channel = grpc.aio.insecure_channel(coordinator.address, options=CHANNEL_OPTIONS)
            stack.push_async_callback(channel.close)
            served = JobsCoordinator(coordinator, channel)
            # Every node first, then the model: its first plan sees them all. A --min-stages
            # layout is kept across re-plans, so one cut while only the first nodes had
            # joined (which a busy machine's debounced re-plan may do) would stay shallower.
            for index in range(nodes):
                await served.add_node(f"n{index}", *([accounts[index]] if accounts else []))
            await coordinator.ctx.model_store.import_model(
                aiter_of(model_messages(tiny_model, MODEL))
            )

            async def leave_all() -> None:
                for node in served.nodes:
                    await node.leave()

            stack.push_async_callback(leave_all)
            return served

        yield start


@pytest.fixture
async def jc(start_jobs: Callable[..., Awaitable[JobsCoordinator]]) -> JobsCoordinator:
    served = await start_jobs()
    await served.ready(replicas=2)
    return served
