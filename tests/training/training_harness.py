"""Real training stage nodes on loopback, a stand-in checkpoint store, a one-process reference.

Each ``TrainingNode`` is a real node data plane: ``node_agent.data_plane.start_server`` on
127.0.0.1 serving ``Stage`` and ``TrainingStage``, a ``ShardManager`` that loads a tiny
random checkpoint through the runtime, capabilities signed with an Ed25519 key standing in
for the coordinator's.

``StandInTrainingStore`` stands in for the coordinator's ``TrainingStore`` where a test
needs no jobs, placement or registry (test_coordinator_store.py uses the real one): a real
grpc.aio servicer that authenticates nodes by their node id and attach ticket, stores the
streamed bytes, checks their size and sha256, and records a step as consistent once every
expected stage of the job uploaded it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from data_plane.stage_harness import OPTIONS, CoordinatorKeys, node_context
from support.checkpoints import make_checkpoint

from client.training_driver import TrainingHop
from node_agent.context import AgentContext
from node_agent.data_plane import start_server
from node_agent.runtime import load_stage_model
from node_agent.runtime.training import StageTrainer, clip_scale
from node_agent.shard_fetcher import NODE_ID_METADATA, TICKET_METADATA
from node_agent.shard_manager import DirectorySource, ShardManager
from node_agent.stage_server import StageServicer
from node_agent.training_server import TrainingLimits, TrainingStageServicer
from protos.tessera.v1 import common_pb2, coordinator_pb2, node_pb2, training_pb2, training_pb2_grpc

MODEL = "tiny-train"
NUM_LAYERS = 4
HIDDEN = 32
VOCAB = 64
SPLIT = [(0, 1), (1, 3), (3, 4)]
MAX_CHECKPOINT_BYTES = 64 << 20


def make_train_checkpoint(directory: Path) -> Path:
    """Like a pretrained model, embedding and head span O(1) logits, so that frozen-base
    LoRA visibly learns too (with the 0.02 init the logits barely move)."""
    gen = np.random.default_rng(5)
    wide = {
        name: ("F32", (0.5 * gen.standard_normal((VOCAB, HIDDEN))).astype("<f4"))
        for name in ("model.embed_tokens.weight", "lm_head.weight")
    }
    return make_checkpoint(
        directory,
        "llama",
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        seed=4,
        extra_tensors=wide,
    )


def hyper(mode: str = "full", **overrides: object) -> training_pb2.TrainingHyper:
    values: dict[str, object] = {
        "mode": mode,
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "lr": 3e-3,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.01,
        "max_grad_norm": 0.5,
        "seed": 7,
        "micro_batches": 2,
    }
    values.update(overrides)
    return training_pb2.TrainingHyper(**values)  # type: ignore[arg-type]


def counting_batch(step: int, batch: int = 4, seq: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """'Continue the count': next token = token + 1 (mod vocab); the last label ignored."""
    rng = np.random.default_rng(1000 + step)
    starts = rng.integers(0, VOCAB, size=(batch, 1))
    tokens = (starts + np.arange(seq)) % VOCAB
    labels = np.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    return tokens.astype(np.int64), labels.astype(np.int64)


# ---- the stand-in coordinator store ---------------------------------------------------------


@dataclass
class StoredCheckpoint:
    data: bytes
    sha256: str
    node_id: str


class StandInTrainingStore(training_pb2_grpc.TrainingStoreServicer):
    """Stands in for the coordinator's TrainingStore: real bytes, real hashes."""

    def __init__(self) -> None:
        self.tickets: dict[str, str] = {}  # node id -> attach ticket (hex)
        self.stages: dict[str, set[tuple[int, int]]] = {}  # job -> the stages it has
        self.stored: dict[tuple[str, int, int, int], StoredCheckpoint] = {}
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        self.server = grpc.aio.server(options=OPTIONS)
        training_pb2_grpc.add_TrainingStoreServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    def consistent(self, job_id: str, step: int) -> bool:
        held = {(s, e) for j, st, s, e in self.stored if j == job_id and st == step}
        return bool(self.stages.get(job_id)) and self.stages[job_id] <= held

    async def _node(self, context: grpc.aio.ServicerContext) -> str:
        metadata = dict(context.invocation_metadata() or ())
        node_id = metadata.get(NODE_ID_METADATA, "")
        if not node_id or self.tickets.get(node_id) != metadata.get(TICKET_METADATA):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown node or ticket")
        return node_id

    async def UploadCheckpoint(self, request_iterator, context):  # noqa: N802
        node_id = await self._node(context)
        header = None
        buffer = bytearray()
        async for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no header first")
                header = chunk.header
                if header.total_bytes > MAX_CHECKPOINT_BYTES:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too large")
            if chunk.offset != len(buffer) or len(buffer) + len(chunk.data) > header.total_bytes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad offset or size")
            buffer += chunk.data
        if header is None or len(buffer) != header.total_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "truncated upload")
        digest = hashlib.sha256(buffer).hexdigest()
        if digest != header.sha256:
            await context.abort(grpc.StatusCode.DATA_LOSS, "sha256 mismatch")
        key = (header.job_id, header.step, header.layers.start, header.layers.end)
        self.stored[key] = StoredCheckpoint(bytes(buffer), digest, node_id)
        return training_pb2.CheckpointReceipt(
            sha256=digest,
            total_bytes=len(buffer),
            consistent=self.consistent(header.job_id, header.step),
        )

    async def DownloadCheckpoint(self, request, context):  # noqa: N802
        await self._node(context)
        key = (request.job_id, request.step, request.layers.start, request.layers.end)
        stored = self.stored.get(key)
        if stored is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint {key}")
        header = training_pb2.CheckpointHeader(
            job_id=request.job_id,
            step=request.step,
            layers=request.layers,
            total_bytes=len(stored.data),
            sha256=stored.sha256,
        )
        size = 64 << 10
        for offset in range(0, len(stored.data), size):
            chunk = training_pb2.CheckpointChunk(
                offset=offset, data=stored.data[offset : offset + size]
            )
            if offset == 0:
                chunk.header.CopyFrom(header)
            yield chunk


class HangsAfterForwards(TrainingStageServicer):
    """Answers ``answers`` ForwardTrain calls, then never answers one again and keeps its
    connection open: a node whose PC went to sleep mid-job."""

    answers = 8

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forwards = 0

    async def ForwardTrain(self, request, context):  # noqa: N802
        self.forwards += 1
        if self.forwards > self.answers:
            await asyncio.Event().wait()
        return await super().ForwardTrain(request, context)


# ---- nodes ------------------------------------------------------------------------------------


@dataclass
class TrainingNode:
    ctx: AgentContext
    manager: ShardManager
    training: TrainingStageServicer
    server: grpc.aio.Server
    port: int
    statuses: list[node_pb2.ShardStatus] = field(default_factory=list)

    @property
    def node_id(self) -> str:
        return self.ctx.node_id

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def hop(self, start: int, end: int) -> TrainingHop:
        return TrainingHop(self.node_id, self.address, start, end)

    @classmethod
    async def start(
        cls,
        checkpoint: Path,
        keys: CoordinatorKeys,
        store: StandInTrainingStore,
        shards: Sequence[tuple[int, int]],
        *,
        data_dir: Path,
        usable_bytes: int = 4 << 30,
        limits: TrainingLimits | None = None,
        servicer_class: type[TrainingStageServicer] = TrainingStageServicer,
    ) -> TrainingNode:
        ctx = node_context(data_dir, keys.public)
        ctx.hardware = dataclasses.replace(ctx.hardware, memory_usable_bytes=usable_bytes)
        ctx.coordinator_address = store.address
        ctx.attach_ticket = secrets.token_bytes(16)
        store.tickets[ctx.node_id] = ctx.attach_ticket.hex()
        manager = ShardManager(DirectorySource(checkpoint), device="cpu")
        ctx.shard_handler = manager
        training = servicer_class(ctx, manager, limits)
        server, port = await start_server(ctx, "127.0.0.1:0", StageServicer(ctx, manager), training)
        node = cls(ctx, manager, training, server, port)
        for start, end in shards:
            await node.assign(start, end)
        return node

    async def assign(self, start: int, end: int) -> None:
        command = coordinator_pb2.AssignShard(
            model=MODEL,
            layers=common_pb2.LayerRange(start=start, end=end),
            dtype="float32",
            num_layers=NUM_LAYERS,
        )
        await self.manager.assign(command, self.statuses.append)
        assert self.statuses[-1].state == node_pb2.SHARD_STATE_READY, self.statuses[-1]

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.training.close()
        self.manager.close()


def training_capability(
    keys: CoordinatorKeys,
    job_id: str,
    grants: Sequence[tuple[TrainingNode, int, int]],
    **options: object,
) -> object:
    return keys.capability(
        job_id, [(n.node_id, s, e) for n, s, e in grants], model=MODEL, **options
    )


# ---- the one-process reference --------------------------------------------------------------


class LocalReference:
    """The whole model trained in one process by one StageTrainer, same schedule of math:
    micro-batch losses scaled by 1/M, global-norm clipping, AdamW."""

    def __init__(self, checkpoint: Path, h: training_pb2.TrainingHyper) -> None:
        self.hyper = h
        self.trainer = StageTrainer(
            load_stage_model(checkpoint, 0, NUM_LAYERS),
            h.mode,  # type: ignore[arg-type]
            lora_rank=h.lora_rank,
            lora_alpha=h.lora_alpha,
            lr=h.lr,
            betas=(h.beta1, h.beta2),
            weight_decay=h.weight_decay,
            eps=h.eps,
            seed=h.seed,
            num_micro_batches=h.micro_batches,
        )

    def step(self, tokens: np.ndarray, labels: np.ndarray) -> float:
        trainer = self.trainer
        losses = []
        parts = zip(
            np.split(tokens, self.hyper.micro_batches),
            np.split(labels, self.hyper.micro_batches),
            strict=True,
        )
        for mb, (x, y) in enumerate(parts):
            losses.append(float(trainer.forward(mb, torch.from_numpy(x), torch.from_numpy(y))))
            trainer.backward(mb)
        scale = clip_scale(trainer.grad_sq_norm(), self.hyper.max_grad_norm)
        trainer.step(scale, trainer.version)
        return sum(losses) / len(losses)

    def state(self) -> dict[str, torch.Tensor]:
        return self.trainer.state_dict()[0]


@contextlib.asynccontextmanager
async def running_store() -> AsyncIterator[StandInTrainingStore]:
    store = StandInTrainingStore()
    await store.start()
    try:
        yield store
    finally:
        await store.stop()


@contextlib.asynccontextmanager
async def node_starter(
    checkpoint: Path, keys: CoordinatorKeys, store: StandInTrainingStore, data_root: Path
) -> AsyncIterator[Callable[..., Awaitable[TrainingNode]]]:
    """start([(0, 2)], **options) -> a running TrainingNode; all are stopped on exit."""
    nodes: list[TrainingNode] = []

    async def start(shards: list[tuple[int, int]], **options: Any) -> TrainingNode:
        node = await TrainingNode.start(
            checkpoint, keys, store, shards, data_dir=data_root / f"node{len(nodes)}", **options
        )
        nodes.append(node)
        return node

    try:
        yield start
    finally:
        for node in nodes:
            await node.stop()
