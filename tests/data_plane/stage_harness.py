"""Real stage servers on loopback, a stand-in coordinator key, and a reference model.

Everything here is real: grpc.aio servers on 127.0.0.1, the node's ShardManager loading a
tiny random checkpoint through the runtime, capabilities signed with an Ed25519 key. The
only stand-in is the coordinator itself (the lead writes it): `FakeCoordinator` serves
the ClientApi calls the client makes, from a fixed layout of stage nodes.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from support.checkpoints import make_checkpoint

from node_agent.context import AgentContext
from node_agent.data_plane import start_server
from node_agent.hardware_probe import HardwareInfo
from node_agent.runtime import load_stage_model
from node_agent.shard_manager import DirectorySource, ShardManager
from node_agent.stage_server import StageLimits, StageServicer
from protos import identity
from protos.dialing import DIAL_OPTIONS
from protos.tessera.v1 import (
    client_api_pb2,
    client_api_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    node_pb2,
)

MODEL = "tiny-llama"
NUM_LAYERS = 4
HIDDEN = 32
VOCAB = 64
MAX_POSITIONS = 256  # the checkpoint's max_position_embeddings
# What a node agent dials with (node_agent.agent.CHANNEL_OPTIONS). The nodes here share one
# process; without a local subchannel pool a node's relay channel could share the backoff
# of an earlier test's connection to a recycled port and fail with "Connection refused".
OPTIONS = list(DIAL_OPTIONS)


def make_tiny_checkpoint(directory: Path, *, seed: int = 7) -> Path:
    return make_checkpoint(
        directory,
        "llama",
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS,
        tokenizer=True,
        seed=seed,
    )


class CoordinatorKeys:
    """Signs capabilities the way the coordinator does."""

    def __init__(self) -> None:
        self.key = identity.generate_private_key()
        self.public = identity.public_key_bytes(self.key)

    def capability(
        self,
        session_id: str,
        grants: Sequence[tuple[str, int, int] | tuple[str, int, int, str]],
        *,
        model: str = MODEL,
        max_tokens: int = 128,
        ttl_s: float = 600.0,
        key: Any = None,
        client_key: bytes = b"",
        usage_credit: int = 0,
    ) -> client_api_pb2.SignedCapability:
        now_ms = int(time.time() * 1000)
        claims = client_api_pb2.CapabilityClaims(
            session_id=session_id,
            model=model,
            # (node id, start, end[, address]): the coordinator's grants carry addresses,
            # which a relay hop must match.
            grants=[
                client_api_pb2.Hop(
                    node_id=g[0],
                    address=g[3] if len(g) > 3 else "",
                    layers=common_pb2.LayerRange(start=g[1], end=g[2]),
                )
                for g in grants
            ],
            issued_unix_ms=now_ms,
            expires_unix_ms=now_ms + int(ttl_s * 1000),
            max_tokens=max_tokens,
            client_public_key=client_key,
            usage_credit=usage_credit,
        )
        return identity.sign_capability(key or self.key, claims)


def node_context(data_dir: Path, coordinator_public: bytes) -> AgentContext:
    key = identity.generate_private_key()
    hardware = HardwareInfo(
        device_kind="cpu",
        torch_device="cpu",
        device_name="test cpu",
        device_count=0,
        memory_total_bytes=8 << 30,
        memory_usable_bytes=4 << 30,
        compute_capability="",
        cpu_cores=2,
        ram_bytes=8 << 30,
    )
    return AgentContext(
        node_id=identity.node_id(identity.public_key_bytes(key)),
        private_key=key,
        data_dir=data_dir,
        hardware=hardware,
        coordinator_address="127.0.0.1:1",
        channel_options=OPTIONS,
        coordinator_public_key=coordinator_public,
    )


@dataclass
class StageNode:
    ctx: AgentContext
    manager: ShardManager
    servicer: StageServicer
    server: grpc.aio.Server
    port: int
    statuses: list[node_pb2.ShardStatus] = field(default_factory=list)

    @property
    def node_id(self) -> str:
        return self.ctx.node_id

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def public_key(self) -> bytes:
        return identity.public_key_bytes(self.ctx.private_key)

    @classmethod
    async def start(
        cls,
        checkpoint: Path,
        coordinator_public: bytes,
        shards: Sequence[tuple[int, int]],
        *,
        data_dir: Path,
        idle_ttl_s: float = 300.0,
        kv_tokens_budget: int = 4096,
        limits: StageLimits | None = None,
        servicer_class: type[StageServicer] = StageServicer,
    ) -> StageNode:
        ctx = node_context(data_dir, coordinator_public)
        manager = ShardManager(DirectorySource(checkpoint), device="cpu", idle_ttl_s=idle_ttl_s)
        ctx.shard_handler = manager
        servicer = servicer_class(ctx, manager, limits)
        # The node agent's own server (its options, interceptors, TrainingStage plug-in).
        server, port = await start_server(ctx, "127.0.0.1:0", servicer)
        node = cls(ctx, manager, servicer, server, port)
        for start, end in shards:
            await node.assign(start, end, kv_tokens_budget=kv_tokens_budget)
        return node

    async def assign(self, start: int, end: int, *, kv_tokens_budget: int = 4096) -> None:
        command = coordinator_pb2.AssignShard(
            model=MODEL,
            layers=common_pb2.LayerRange(start=start, end=end),
            dtype="float32",
            kv_tokens_budget=kv_tokens_budget,
            num_layers=NUM_LAYERS,
        )
        await self.manager.assign(command, self.statuses.append)
        assert self.statuses[-1].state == node_pb2.SHARD_STATE_READY, self.statuses[-1]

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.servicer.close()
        self.manager.close()


def hop(node: StageNode, start: int, end: int) -> client_api_pb2.Hop:
    return client_api_pb2.Hop(
        node_id=node.node_id,
        address=node.address,
        layers=common_pb2.LayerRange(start=start, end=end),
    )


def session_grant(
    keys: CoordinatorKeys,
    stages: Sequence[tuple[int, int, StageNode, Sequence[StageNode]]],
    *,
    session_id: str | None = None,
    max_tokens: int = 128,
    model: str = MODEL,
    client_key: bytes = b"",
    usage_credit: int = 0,
) -> client_api_pb2.SessionGrant:
    """A SessionGrant for stages given as (start, end, primary, alternates); with
    ``client_key`` and ``usage_credit``, a paid session's."""
    session_id = session_id or "s-" + secrets.token_hex(6)
    grants = [
        (node.node_id, start, end, node.address)
        for start, end, primary, alternates in stages
        for node in [primary, *alternates]
    ]
    return client_api_pb2.SessionGrant(
        session_id=session_id,
        stages=[
            client_api_pb2.RouteStage(
                layers=common_pb2.LayerRange(start=start, end=end),
                primary=hop(primary, start, end),
                alternates=[hop(a, start, end) for a in alternates],
            )
            for start, end, primary, alternates in stages
        ],
        capability=keys.capability(
            session_id,
            grants,
            model=model,
            max_tokens=max_tokens,
            client_key=client_key,
            usage_credit=usage_credit,
        ),
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
    )


# ---- reference: the whole model in this process ------------------------------------------


def reference_logits(checkpoint: Path, token_ids: Sequence[int]) -> np.ndarray:
    """float32 logits [T, vocab] of one prefill through the full model."""
    model = load_stage_model(checkpoint, 0, NUM_LAYERS)
    with torch.inference_mode():
        out = model(torch.tensor([list(token_ids)], dtype=torch.int64))
    return out[0].numpy()


def reference_greedy(checkpoint: Path, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """Greedy ids from the full model with its own KV cache: prefill, then one at a time."""
    model = load_stage_model(checkpoint, 0, NUM_LAYERS)
    cache = model.new_cache(len(prompt) + new_tokens)
    generated: list[int] = []
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt)]), cache, 0)
        position = len(prompt)
        for _ in range(new_tokens):
            token = int(torch.argmax(logits[0, -1]))
            generated.append(token)
            logits = model(torch.tensor([[token]]), cache, position)
            position += 1
    return generated


# ---- a stand-in coordinator for the client API --------------------------------------------


class FakeCoordinator(client_api_pb2_grpc.ClientApiServicer):
    """Routes every session over a fixed layout; Reroute covers a span with spare nodes."""

    def __init__(
        self,
        keys: CoordinatorKeys,
        checkpoint: Path,
        layout: Sequence[tuple[int, int, StageNode, Sequence[StageNode]]],
        spares: Sequence[tuple[int, int, StageNode]] = (),
    ) -> None:
        self.keys = keys
        self.layout = list(layout)
        self.spares = list(spares)
        self.config_json = (checkpoint / "config.json").read_text()
        self.tokenizer_json = (checkpoint / "tokenizer.json").read_bytes()
        self.opened: list[client_api_pb2.OpenSessionRequest] = []
        self.reroutes: list[client_api_pb2.RerouteRequest] = []
        self.closed: list[str] = []
        self.refuse_sessions = ""  # when set, OpenSession answers UNAVAILABLE with this
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> str:
        self.server = grpc.aio.server(options=OPTIONS)
        client_api_pb2_grpc.add_ClientApiServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    def _info(self) -> client_api_pb2.ModelInfo:
        return client_api_pb2.ModelInfo(
            name=MODEL,
            architecture="LlamaForCausalLM",
            num_layers=NUM_LAYERS,
            hidden_size=HIDDEN,
            vocab_size=VOCAB,
            has_tokenizer=True,
            available=True,
            max_positions=MAX_POSITIONS,
        )

    async def ListNodes(self, request, context):  # noqa: N802
        nodes = {n.node_id: n for _, _, p, alts in self.layout for n in [p, *alts]}
        return client_api_pb2.ListNodesResponse(
            nodes=[
                node_pb2.NodeInfo(
                    node_id=n.node_id,
                    name=f"node-{i}",
                    state=node_pb2.NODE_STATE_ONLINE,
                    capabilities=node_pb2.Capabilities(
                        device_kind="cpu",
                        device_name="test cpu",
                        memory_usable_bytes=4 << 30,
                        matmul_tflops=0.5,
                    ),
                    last_seen_unix_ms=int(time.time() * 1000) - 3000,
                    data_address=n.address,
                )
                for i, n in enumerate(nodes.values())
            ]
        )

    async def ListModels(self, request, context):  # noqa: N802
        return client_api_pb2.ListModelsResponse(models=[self._info()])

    async def GetModel(self, request, context):  # noqa: N802
        if request.name != MODEL:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no model {request.name!r}")
        return client_api_pb2.ModelDetail(
            info=self._info(), config_json=self.config_json, tokenizer_json=self.tokenizer_json
        )

    async def OpenSession(self, request, context):  # noqa: N802
        if self.refuse_sessions:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.refuse_sessions)
        self.opened.append(request)
        grant = session_grant(self.keys, self.layout, max_tokens=request.max_length)
        # Spares are granted up front too, so a Reroute to them needs no new key material.
        return grant

    async def Reroute(self, request, context):  # noqa: N802
        self.reroutes.append(request)
        claims = identity.open_capability(self.keys.public, request.capability)
        if claims is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad capability")
        excluded = set(request.exclude_node_ids)
        chain = [
            (s, e, n)
            for s, e, n in self.spares
            if n.node_id not in excluded and request.span.start <= s and e <= request.span.end
        ]
        covered = sorted(chain, key=lambda c: c[0])
        if not covered or covered[0][0] != request.span.start or covered[-1][1] != request.span.end:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica left for that span")
        hops = [hop(n, s, e) for s, e, n in covered]
        grants = [(g.node_id, g.layers.start, g.layers.end, g.address) for g in claims.grants]
        grants += [(n.node_id, s, e, n.address) for s, e, n in covered]
        capability = self.keys.capability(claims.session_id, grants, max_tokens=claims.max_tokens)
        return client_api_pb2.RerouteResponse(hops=hops, capability=capability)

    async def CloseSession(self, request, context):  # noqa: N802
        self.closed.append(request.session_id)
        return common_pb2.Empty()


class BackgroundLoop:
    """An event loop on its own thread, hosting servers while a sync test blocks."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def nowhere() -> str:
    """A loopback address nobody listens at: connections to it are refused."""
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    closed.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    return address


def cut_link(a: StageNode, b: StageNode) -> grpc.aio.Channel:
    """From now on ``a``'s relays to ``b`` go to a port nobody listens at: ``a`` cannot
    reach ``b``, though the client reaches both (a firewall between two homes)."""
    channel = grpc.aio.insecure_channel(nowhere())
    a.servicer._relay._channels[b.address] = channel
    return channel
