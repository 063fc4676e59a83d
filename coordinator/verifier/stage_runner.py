"""The coordinator as a data-plane client: it runs inputs on a node's Stage service itself.

Arbitration and canaries both need it. Each run opens a fresh session with a capability
the coordinator signs like any client's: random session id, the usual TTL, a plausible
token budget, and grants for the target and a few other replicas of its layers, dressed
exactly as a session grant dresses them (``describe`` fills in keys, accounts and check
probabilities). A node cannot tell a check from real traffic.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protos import identity
from protos.dialing import DIAL_OPTIONS
from protos.tessera.v1 import client_api_pb2, common_pb2, stage_pb2, stage_pb2_grpc

TOKEN_TTL_S = 3600.0
OPTIONS = DIAL_OPTIONS


@dataclass(frozen=True)
class StageRun:
    session_id: str
    response: stage_pb2.ForwardResponse


class StageRunner:
    def __init__(
        self,
        signing_key: Ed25519PrivateKey,
        describe: Callable[[client_api_pb2.Hop], None] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self._key = signing_key
        self._describe = describe
        self._timeout_s = timeout_s
        self._rng = random.Random()
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def run(
        self,
        node_id: str,
        address: str,
        model: str,
        start: int,
        end: int,
        chunks: list[common_pb2.Tensor],
        *,
        last_position_only: bool = False,
        also_granted: Sequence[str] = (),
    ) -> StageRun:
        """Feed ``chunks`` in order from position 0; the answer to the last one comes back.
        ``also_granted``: other replicas of the layers, granted as a real route would."""
        session_id = "s" + secrets.token_hex(12)
        tokens = sum(int(c.shape[1]) for c in chunks)
        capability = self._capability(
            session_id, model, [node_id, *also_granted], start, end, tokens
        )
        stub = stage_pb2_grpc.StageStub(self._channel(address))
        call = stub.Forward(timeout=self._timeout_s)
        position = 0
        answer: stage_pb2.ForwardResponse | None = None
        try:
            for step, chunk in enumerate(chunks, start=1):
                request = stage_pb2.ForwardRequest(
                    session_id=session_id,
                    step=step,
                    model=model,
                    layers=common_pb2.LayerRange(start=start, end=end),
                    start_pos=position,
                    input=chunk,
                    last_position_only=last_position_only,
                )
                if step == 1:
                    request.capability.CopyFrom(capability)
                await call.write(request)
                read = await call.read()
                if read is grpc.aio.EOF:
                    raise ConnectionError(f"node {node_id} ended the stream without answering")
                answer = read
                position += int(chunk.shape[1])
        finally:
            call.cancel()
        assert answer is not None, "run() needs at least one chunk"
        try:
            await stub.EndSession(
                stage_pb2.EndSessionRequest(session_id=session_id, capability=capability),
                timeout=5.0,
            )
        except grpc.aio.AioRpcError:
            pass  # the cache expires on its own
        return StageRun(session_id, answer)

    def _capability(
        self, session_id: str, model: str, node_ids: list[str], start: int, end: int, tokens: int
    ) -> client_api_pb2.SignedCapability:
        now = int(time.time() * 1000)
        grants = []
        for node_id in node_ids:
            hop = client_api_pb2.Hop(
                node_id=node_id, layers=common_pb2.LayerRange(start=start, end=end)
            )
            if self._describe is not None:
                self._describe(hop)
            grants.append(hop)
        claims = client_api_pb2.CapabilityClaims(
            session_id=session_id,
            model=model,
            grants=grants,
            issued_unix_ms=now,
            expires_unix_ms=now + int(TOKEN_TTL_S * 1000),
            # A prompt plus a generation budget, as clients ask for.
            max_tokens=tokens + self._rng.choice((32, 64, 128, 256)),
        )
        return identity.sign_capability(self._key, claims)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=OPTIONS)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
