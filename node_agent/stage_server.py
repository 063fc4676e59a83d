"""The node's data plane: the ``Stage`` gRPC service that runs pipeline stages for clients.

``Forward`` is one bidirectional stream per (session, node). Its first message carries the
coordinator-signed capability, checked offline here. Every request is validated before it
touches the model: who may ask (capability), what they ask for (a READY shard, granted
layers), and the tensor itself (dtype, shape, hidden size, token ids, NaN/inf, lengths,
positions). A bad request ends only its own stream, with a status code and a message a
person can act on; other sessions never notice. Model work runs on the shard manager's
single compute thread so the event loop stays responsive, except a decode step that finds
that thread idle, which runs inline (cheaper than two thread hand-offs); requests of one
session are serialised. Every output is signed (session, step, layers, digest of the
session's input prefix, sha256 of the output bytes): the prefix digest binds the output to
the history that produced it, so a signed wrong output is evidence a verifier can replay.
A node granted consecutive stages of a session serves them as one hop too.

Push pipeline: a call with ``relay_to`` is also sent on, by this node, to the next hop of
the route (every hop checked against the capability first); a call that arrives so
(``relayed``) is answered on the session's ``Deliveries`` stream here instead of on its
own stream. The machinery (outgoing links, subscriptions) lives in ``node_agent.relay``. A
hop to this very node (consecutive stages of the route here) is handed over in-process. A
hand-off that fails at once (next node unreachable, link backed up) is named in this call's
answer (``relay_failed``), so the client sends the rest of the step without waiting.

Ring: a call with ``ring`` that ends the model also starts the next step. This node samples
the next token from its logits (protos.sampling, the draw the client makes from the same
signed logits) and relays that token to the ring's first hop, with the rest of the route
and one step less, unless the ring has no steps left or the token ends the sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import grpc
import numpy as np
import torch

from node_agent import failpoints
from node_agent.acknowledgments import check_credit, take_acknowledgments
from node_agent.context import AgentContext
from node_agent.data_plane import answer_ping
from node_agent.receipts import UsageMeter, save_usage
from node_agent.relay import DeliveryHub, RelayLimits, RelayLinks, Subscriber, SubscriptionEnded
from node_agent.runtime import CacheBudgetError, CacheFullError, StageKVCache
from node_agent.shard_manager import (
    LoadedShard,
    ShardKey,
    ShardManager,
    cache_key,
    session_of,
    shard_manager_for,
)
from node_agent.stage_errors import StageError
from node_agent.usage_settlement import UsageSettler, settle_every_s
from protos import codec, identity, logit_probes, output_check
from protos.quoting import shown
from protos.sampling import SamplingParams, draw_at
from protos.tessera.v1 import client_api_pb2, common_pb2, stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

# End-of-sequence ids a ring may carry: models have one to a few.
MAX_STOP_IDS = 64
# Where the usage counts of inference sessions are kept, in the data dir (receipts.py).
USAGE_FILE = "usage/inference.json"


@dataclass(frozen=True)
class StageLimits:
    max_batch: int = 8
    max_tokens_per_request: int = 4096
    # Room for the protobuf envelope below the 64 MiB message limit.
    max_output_bytes: int = codec.MAX_MESSAGE_BYTES - (1 << 20)
    expiry_interval_s: float = 5.0
    # A decode step (at most this many positions, batch x tokens) whose stage took at most
    # inline_max_ms last time runs on the event loop when the compute thread is idle: the
    # loop then stalls for no longer than that. 0 sends every step to the compute thread.
    inline_max_tokens: int = 1
    inline_max_ms: float = 100.0
    relay: RelayLimits = field(default_factory=RelayLimits)
    # How often acknowledged receipts go to the coordinator (node_agent.usage_settlement).
    settle_every_s: float = field(default_factory=settle_every_s)


@dataclass
class _StreamState:
    claims: client_api_pb2.CapabilityClaims | None = None
    # As received: what this node passes on with the calls it relays from this stream.
    signed: client_api_pb2.SignedCapability | None = None


def open_capability(
    ctx: AgentContext, signed: client_api_pb2.SignedCapability
) -> client_api_pb2.CapabilityClaims:
    """The claims of a coordinator-signed capability, checked offline with its key."""
    coordinator_key = ctx.coordinator_public_key
    if not coordinator_key:
        raise StageError(
            grpc.StatusCode.UNAVAILABLE,
            "this node has not registered with its coordinator yet, so it cannot check "
            "capabilities; retry in a moment or use another replica",
        )
    claims = identity.open_capability(coordinator_key, signed)
    if claims is None:
        raise StageError(
            grpc.StatusCode.UNAUTHENTICATED,
            "the capability's signature does not verify with this node's coordinator key "
            "(forged, corrupted, or issued by another coordinator)",
        )
    return claims


def check_expiry(claims: client_api_pb2.CapabilityClaims, now_s: float) -> None:
    if claims.expires_unix_ms <= int(now_s * 1000):
        when = datetime.fromtimestamp(claims.expires_unix_ms / 1000, tz=UTC)
        raise StageError(
            grpc.StatusCode.UNAUTHENTICATED,
            f"token expired at {when.isoformat(timespec='seconds')}; open a new session "
            "(or Reroute for a fresh capability)",
        )


def check_grant(
    claims: client_api_pb2.CapabilityClaims, node_id: str, model: str, start: int, end: int
) -> None:
    """The capability must be for ``model`` and grant this node layers covering
    [start, end), a non-empty range, possibly as several consecutive grants."""
    if model != claims.model:
        raise StageError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"the capability is for model {claims.model!r}, the request names {shown(model)}",
        )
    if start >= end:
        raise StageError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"layer range [{start}, {end}) is empty; a stage needs start < end",
        )
    mine = [g.layers for g in claims.grants if g.node_id == node_id]
    if not mine:
        raise StageError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"this node ({node_id}) is not among the nodes the capability grants",
        )
    if not _granted(mine, start, end):
        granted = ", ".join(f"[{g.start}, {g.end})" for g in mine)
        raise StageError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"layers [{start}, {end}) are outside what the capability grants this node: {granted}",
        )


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(
        self,
        ctx: AgentContext,
        shards: ShardManager,
        limits: StageLimits | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._ctx = ctx
        self._shards = shards
        self.limits = limits or StageLimits()
        # Capabilities expire by the coordinator's clock (AgentContext.coordinator_time).
        self._clock = clock or ctx.coordinator_time
        self._cache_locks: dict[str, asyncio.Lock] = {}  # by cache_key(session, start, end)
        self._expiry_task: asyncio.Task[None] | None = None
        self._usage = UsageMeter(ctx.private_key, path=ctx.data_dir / USAGE_FILE)
        self._settler = UsageSettler(
            ctx.coordinator_address, ctx.channel_options, self.limits.settle_every_s
        )
        # Per session key: digest of the input prefix after each cached position.
        self._input_chains: dict[str, list[bytes]] = {}
        self._failpoints = failpoints.from_env()  # None unless TESSERA_FAILPOINTS is set
        # The last compute time of each stage (shard, start, end), in ms: whether its next
        # decode step is short enough to run inline.
        self._step_ms: dict[tuple[ShardKey, int, int], float] = {}
        # Push pipeline: the sessions' Deliveries subscribers here, the outgoing links, and
        # per cache key the newest step any call ran with and the newest one the client sent
        # itself (older relayed calls, and rings the client started before, are stale).
        self._deliveries = DeliveryHub(self.limits.relay)
        self._relay = RelayLinks(ctx.channel_options, self.limits.relay)
        self._newest_step: dict[str, _StepsSeen] = {}
        self._relays_here: set[asyncio.Task[None]] = set()  # hand-offs to this node itself

    # ---- RPCs -----------------------------------------------------------------------

    async def Ping(  # noqa: N802 - gRPC method name
        self, request: stage_pb2.PingRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.PingResponse:
        return await answer_ping(request, context, self._ctx.node_id)

    async def Forward(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[stage_pb2.ForwardRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[stage_pb2.ForwardResponse]:
        self._start_expiry()
        stream = _StreamState()
        try:
            async for request in request_iterator:
                if request.relayed:
                    await self._relayed_one(request, stream)
                    continue
                response = await self._forward_one(request, stream)
                assert response is not None  # only relayed calls can be stale
                yield response
        except StageError as err:
            log.info("Forward refused (%s): %s", err.code.name, err.message)
            await context.abort(err.code, err.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as err:  # a bug here must end one stream, not the server
            log.exception("Forward failed unexpectedly")
            await context.abort(
                grpc.StatusCode.INTERNAL, f"the node hit an internal error: {type(err).__name__}"
            )

    async def EndSession(  # noqa: N802 - gRPC method name
        self, request: stage_pb2.EndSessionRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Empty:
        try:
            self._session_claims("EndSession", request)
            self._end_relay(request.session_id)
            # Waits for the session's running steps, so no cache is pulled from under a
            # compute thread. Forward holds one of these locks at a time: no deadlock.
            async with contextlib.AsyncExitStack() as held:
                for key in sorted(self._cache_locks):
                    if session_of(key) == request.session_id:
                        await held.enter_async_context(self._cache_locks[key])
                released = self._release_session(request.session_id)
                self._usage.forget(request.session_id)
            if not released:
                raise StageError(
                    grpc.StatusCode.NOT_FOUND,
                    f"this node holds no cache for session {request.session_id!r} (never "
                    "opened here, already ended, or expired after idling)",
                )
        except StageError as err:
            await context.abort(err.code, err.message)
        log.info("session %s ended", request.session_id)
        return common_pb2.Empty()

    async def Acknowledge(  # noqa: N802 - gRPC method name
        self, request: stage_pb2.AcknowledgeRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.AcknowledgeResponse:
        try:
            return self._acknowledge(request)
        except StageError as err:
            log.info("Acknowledge refused (%s): %s", err.code.name, err.message)
            await context.abort(err.code, err.message)
            raise  # abort raises; this keeps type checkers content

    def _acknowledge(self, request: stage_pb2.AcknowledgeRequest) -> stage_pb2.AcknowledgeResponse:
        claims = self._session_claims("Acknowledge", request)
        return take_acknowledgments(self._usage, self._settler, claims, request.usage)

    async def Deliveries(  # noqa: N802 - gRPC method name
        self, request: stage_pb2.DeliveriesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.Delivery]:
        self._start_expiry()
        try:
            subscriber = self._subscribe(request)
        except StageError as err:
            log.info("Deliveries refused (%s): %s", err.code.name, err.message)
            await context.abort(err.code, err.message)
        try:
            # Headers now, not with the first delivery: a client that awaits them knows its
            # subscription is in place before it sends relayed calls.
            await context.send_initial_metadata(())
            while (delivery := await subscriber.next()) is not None:
                yield delivery
        except SubscriptionEnded as err:
            await context.abort(err.code, err.message)
        finally:
            self._deliveries.release(subscriber)

    def _subscribe(self, request: stage_pb2.DeliveriesRequest) -> Subscriber:
        claims = self._session_claims("Deliveries", request)
        self._check_expiry(claims)
        if not any(g.node_id == self._ctx.node_id for g in claims.grants):
            raise StageError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this node ({self._ctx.node_id}) is not among the nodes the capability "
                "grants: it runs no call of this session",
            )
        # Tied to sessions: no more subscriptions than the sessions this node may serve.
        cap = self.limits.relay.max_subscriptions
        if self._ctx.max_sessions:
            cap = min(cap, self._ctx.max_sessions)
        subscriber = self._deliveries.subscribe(request.session_id, cap)
        if isinstance(subscriber, str):
            raise StageError(grpc.StatusCode.RESOURCE_EXHAUSTED, subscriber)
        return subscriber

    def _end_relay(self, session_id: str) -> None:
        """The session's subscription and outgoing links end with it."""
        self._deliveries.end_session(session_id)
        self._relay.end_sessions([session_id])

    # ---- Forward, one request -------------------------------------------------------

    def _stream_claims(
        self, request: stage_pb2.ForwardRequest, stream: _StreamState
    ) -> client_api_pb2.CapabilityClaims:
        if request.HasField("capability"):
            stream.claims = self._open_capability(request.capability)
            stream.signed = request.capability
        claims = stream.claims
        if claims is None:
            raise StageError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the first message of a Forward stream must carry the session's capability "
                "(from OpenSession or Reroute)",
            )
        return claims

    async def _relayed_one(self, request: stage_pb2.ForwardRequest, stream: _StreamState) -> None:
        """A call another node relayed here: the answer, or why there is none, goes to the
        session's Deliveries stream; the stream it came on (node to node) stays open."""
        # Without a capability of the request's own session nothing can be delivered to
        # anyone: those errors end the stream, as on a client's stream.
        claims = self._stream_claims(request, stream)
        if request.session_id != claims.session_id:
            raise StageError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the capability is for session {claims.session_id!r}, the relayed request "
                f"names {shown(request.session_id)}",
            )
        delivery = stage_pb2.Delivery(step=request.step, layers=request.layers)
        try:
            response = await self._forward_one(request, stream)
            if response is None:
                return  # stale: the client went on without it
            delivery.response.CopyFrom(response)
        except StageError as err:
            log.info(
                "relayed step %d of %s refused (%s): %s",
                request.step,
                request.session_id,
                err.code.name,
                err.message,
            )
            delivery.error_code = err.code.value[0]
            delivery.error_message = err.message
        except Exception as err:  # a bug must not end the link, nor the server
            log.exception("relayed Forward failed unexpectedly")
            delivery.error_code = grpc.StatusCode.INTERNAL.value[0]
            delivery.error_message = f"the node hit an internal error: {type(err).__name__}"
        if not self._deliveries.deliver(request.session_id, delivery):
            log.info(
                "no Deliveries subscriber for session %s here; dropped the answer to step %d",
                request.session_id,
                request.step,
            )

    async def _forward_one(
        self, request: stage_pb2.ForwardRequest, stream: _StreamState
    ) -> stage_pb2.ForwardResponse | None:
        """Validate, compute and sign one call (and relay it on, with ``relay_to``).
        None for a stale relayed call, which is dropped unseen."""
        claims = self._stream_claims(request, stream)
        start, end = request.layers.start, request.layers.end
        session_key = cache_key(request.session_id, start, end)
        if self._is_stale(request, session_key):
            return None
        self._check_expiry(claims)
        self._authorize(claims, request, start, end)
        shard = self._shards.find(request.model, start, end)
        if shard is None:
            raise StageError(
                grpc.StatusCode.NOT_FOUND,
                f"no READY shard of {request.model!r} covers layers [{start}, {end}) on this "
                f"node (it holds {self._shards.describe(request.model)}); ask the coordinator "
                "to reroute",
            )
        self._check_relay(claims, request, shard)
        array = self._decode_input(request, shard)
        batch, tokens = int(array.shape[0]), int(array.shape[1])
        if request.HasField("ring"):
            self._check_ring(claims, request, shard, batch)
        if request.probes:
            _check_probes(request, shard, batch, tokens, self.limits)
        self._check_length(request, claims, shard, batch, tokens)
        check_credit(self._usage, claims, request.session_id, start, end)
        shard.enter()
        try:
            # One lock per cache, not per session: a check this node runs for one span of a
            # session must not hold up its pipeline call on another span of the same one.
            async with self._lock_for(session_key):
                if self._is_stale(request, session_key):  # a direct step got in first
                    return None
                seen = self._newest_step.setdefault(session_key, _StepsSeen())
                seen.step = max(seen.step, request.step)
                if not request.relayed:
                    seen.direct = max(seen.direct, request.step)
                cache = self._cache_for(shard, session_key, request, claims, batch, tokens)
                output, compute_ms, probed = await self._compute(
                    shard, start, end, array, cache, request
                )
                cache_length = cache.length
                input_digest = self._extend_chain(session_key, request.start_pos, array, request)
        finally:
            shard.leave()
        if self._failpoints is not None:
            output = await self._failpoints.apply(output, request.input)
        relay_failed = None
        if request.relay_to:
            # Sent before this node signs and answers (at once on an idle link, else by the
            # link's own writer task): the next hop starts as early as possible.
            relay_failed = await self._relay_on(request, output, stream)
        elif request.HasField("ring") and request.ring.steps > 0 and end == shard.num_layers:
            # The hop that ends the model (last_position_only, checked): its logits.
            relay_failed = await self._ring_on(request, output, stream, tokens)
        digest = hashlib.sha256(output.data).digest()
        signature = self._ctx.private_key.sign(
            identity.output_payload(
                request.session_id, request.step, start, end, digest, input_digest=input_digest
            )
        )
        return stage_pb2.ForwardResponse(
            step=request.step,
            output=output,
            compute_ms=compute_ms,
            cache_length=cache_length,
            signature=signature,
            usage=self._usage.record(
                request.session_id,
                start,
                end,
                request.step,
                batch * tokens,
                claims.client_public_key,
                longest=batch * cache_length,
            ),  # fmt: skip
            input_digest=input_digest,
            probe_answers=probed,
            relay_failed=relay_failed,
        )

    def _extend_chain(
        self, session_key: str, start_pos: int, array: np.ndarray, request: stage_pb2.ForwardRequest
    ) -> bytes:
        chain = self._input_chains.setdefault(session_key, [])
        del chain[start_pos:]  # a rollback or replay rewrites the tail
        chain.extend(
            output_check.input_chain(chain[-1] if chain else None, array, request.input.dtype)
        )
        return chain[-1]

    def _session_claims(
        self,
        rpc: str,
        request: stage_pb2.EndSessionRequest
        | stage_pb2.DeliveriesRequest
        | stage_pb2.AcknowledgeRequest,
    ) -> client_api_pb2.CapabilityClaims:
        """The claims of the capability a per-session RPC carries, which must be of the
        session it names (its expiry is for the caller to check, or not)."""
        if not request.HasField("capability"):
            raise StageError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{rpc} must carry the session's capability (from OpenSession or Reroute)",
            )
        claims = self._open_capability(request.capability)
        if claims.session_id != request.session_id:
            raise StageError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the capability is for session {claims.session_id!r}, not "
                f"{shown(request.session_id)}",
            )
        return claims

    def _open_capability(
        self, signed: client_api_pb2.SignedCapability
    ) -> client_api_pb2.CapabilityClaims:
        return open_capability(self._ctx, signed)

    def _check_expiry(self, claims: client_api_pb2.CapabilityClaims) -> None:
        check_expiry(claims, self._clock())

    def _authorize(
        self,
        claims: client_api_pb2.CapabilityClaims,
        request: stage_pb2.ForwardRequest,
        start: int,
        end: int,
    ) -> None:
        if request.session_id != claims.session_id:
            raise StageError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the capability is for session {claims.session_id!r}, the request names "
                f"{shown(request.session_id)}",
            )
        check_grant(claims, self._ctx.node_id, request.model, start, end)

    def _is_stale(self, request: stage_pb2.ForwardRequest, session_key: str) -> bool:
        """A relayed call not newer than a step this cache already ran, or one of a ring
        older than a step the client has sent here since: the client has gone on without
        it (sent that step itself, or a later one)."""
        if not request.relayed:
            return False
        seen = self._newest_step.get(session_key)
        if seen is None:
            return False
        if request.step <= seen.step:
            why = f"step {seen.step} already ran"
        elif request.HasField("ring") and request.ring.origin_step < seen.direct:
            why = f"its ring began at {request.ring.origin_step}, the client sent {seen.direct}"
        else:
            return False
        log.debug("dropped stale relayed step %d of %s (%s)", request.step, session_key, why)
        return True

    def _check_relay(
        self,
        claims: client_api_pb2.CapabilityClaims,
        request: stage_pb2.ForwardRequest,
        shard: LoadedShard,
    ) -> None:
        """``relay_to`` must continue this call's layers hop by hop to hops the capability
        grants, node id and address: a client must not make a node dial anywhere else."""
        hops = request.relay_to
        if not hops:
            return
        limit = self.limits.relay.max_hops
        if len(hops) > limit:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"relay_to has {len(hops)} hops; this node relays along at most {limit}",
            )
        previous = self._check_hops(claims, hops, request.layers.end, shard, "relay_to")
        if request.last_position_only and previous != shard.num_layers:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"last_position_only asks for logits, but relay_to ends at layer {previous}, "
                f"before the model's last layer ({shard.num_layers}); set it only when the "
                "last hop ends there",
            )

    def _check_hops(
        self,
        claims: client_api_pb2.CapabilityClaims,
        hops: Sequence[stage_pb2.RelayHop],
        first_start: int,
        shard: LoadedShard,
        field_name: str,
    ) -> int:
        """Hops must continue the layers from ``first_start`` without a gap, each one a hop
        the capability grants (node id, address and layers): a client must not make a node
        dial anywhere else. Returns the layer the last hop ends at."""
        previous = first_start
        for index, hop in enumerate(hops):
            start, end = hop.layers.start, hop.layers.end
            where = f"{field_name}[{index}] ({hop.node_id or '?'} at {hop.address or '?'})"
            if start != previous:
                raise StageError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where} starts at layer {start}, but the hop before it ends at "
                    f"{previous}: hops must continue the layers without a gap",
                )
            if start >= end or end > shard.num_layers:
                raise StageError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where} has layers [{start}, {end}); a hop needs start < end <= "
                    f"{shard.num_layers} (the model's layers)",
                )
            if not hop.address:
                raise StageError(grpc.StatusCode.INVALID_ARGUMENT, f"{where} has no address")
            granted = [
                g.layers
                for g in claims.grants
                if g.node_id == hop.node_id and g.address == hop.address
            ]
            if not _granted(granted, start, end):
                raise StageError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{where} with layers [{start}, {end}) is not a hop the capability grants "
                    "(node id, address and layers must match a grant); this node relays only "
                    "to the session's granted nodes",
                )
            previous = end
        return previous

    def _check_ring(
        self,
        claims: client_api_pb2.CapabilityClaims,
        request: stage_pb2.ForwardRequest,
        shard: LoadedShard,
        batch: int,
    ) -> None:
        """A ring must go round the whole model through granted hops, draw one token at a
        time from the last position's logits, and stay within the session's budget."""
        ring = request.ring
        limit = self.limits.relay.max_hops
        if not ring.route or len(ring.route) > limit:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ring.route has {len(ring.route)} hops; a ring needs 1 to {limit}, the "
                "session's whole route from layer 0",
            )
        end = self._check_hops(claims, ring.route, 0, shard, "ring.route")
        if end != shard.num_layers:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ring.route ends at layer {end}, before the model's last layer "
                f"({shard.num_layers}): a ring must cover the whole model",
            )
        if not request.last_position_only or batch != 1:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a ring draws one token from the last position's logits: it needs "
                f"last_position_only and a batch of 1 (got batch {batch})",
            )
        if ring.steps > claims.max_tokens:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ring.steps {ring.steps} exceeds the session's budget of {claims.max_tokens} "
                "tokens",
            )
        if ring.origin_step > request.step:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ring.origin_step {ring.origin_step} is after this step ({request.step}): "
                "it is the step the client started the ring with",
            )
        if len(ring.stop_token_ids) > MAX_STOP_IDS:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ring.stop_token_ids has {len(ring.stop_token_ids)} ids; at most "
                f"{MAX_STOP_IDS} are accepted",
            )
        try:
            _ring_params(ring)
        except ValueError as err:
            raise StageError(grpc.StatusCode.INVALID_ARGUMENT, f"ring: {err}") from err

    async def _relay_on(
        self,
        request: stage_pb2.ForwardRequest,
        output: common_pb2.Tensor,
        stream: _StreamState,
    ) -> str | None:
        """Send this call's output (the very bytes it signs) on to relay_to[0]; why that
        failed at once, or None."""
        hop, rest = request.relay_to[0], request.relay_to[1:]
        onward = stage_pb2.ForwardRequest(
            session_id=request.session_id,
            step=request.step,
            model=request.model,
            layers=hop.layers,
            start_pos=request.start_pos,
            input=output,
            # Checked in _check_relay: the route's last hop ends at the last layer.
            last_position_only=request.last_position_only,
            relay_to=rest,
            relayed=True,
            ring=request.ring if request.HasField("ring") else None,
        )
        return await self._send_on(hop, onward, stream)

    async def _ring_on(
        self,
        request: stage_pb2.ForwardRequest,
        output: common_pb2.Tensor,
        stream: _StreamState,
        tokens: int,
    ) -> str | None:
        """Draw the next token from this call's logits and start its step at the ring's
        first hop (checked in _check_ring), unless it ends the sequence; why that failed
        at once, or None."""
        ring = request.ring
        position = request.start_pos + tokens
        try:
            logits = np.frombuffer(output.data, dtype=np.float32)
            token = draw_at(logits, _ring_params(ring), position)
        except ValueError as err:  # logits with nothing finite: the client sees them too
            log.warning("ring of %s stopped at step %d: %s", request.session_id, request.step, err)
            return f"the ring stopped: {err}"
        if token in ring.stop_token_ids:
            return None
        head = ring.route[0]
        onward = stage_pb2.ForwardRequest(
            session_id=request.session_id,
            step=request.step + 1,
            model=request.model,
            layers=head.layers,
            start_pos=position,
            input=codec.encode(np.array([[token]], dtype=np.int64), "int64"),
            last_position_only=True,
            relay_to=ring.route[1:],
            relayed=True,
            ring=ring,
        )
        onward.ring.steps = ring.steps - 1
        return await self._send_on(head, onward, stream)

    async def _send_on(
        self, hop: stage_pb2.RelayHop, onward: stage_pb2.ForwardRequest, stream: _StreamState
    ) -> str | None:
        assert stream.signed is not None  # the stream's claims came from it
        if hop.node_id == self._ctx.node_id:
            return self._relay_here(onward, stream)
        return await self._relay.send(hop.address, onward, stream.signed)

    def _relay_here(self, onward: stage_pb2.ForwardRequest, stream: _StreamState) -> str | None:
        """The next hop is this very node (the route gave it consecutive stages): the call
        is handed over in-process, as if it had come on a link, but without a round trip
        through gRPC and the loopback, and still answered, signed and checked per stage."""
        if len(self._relays_here) >= self.limits.relay.link_queue:
            # As a full link does: the step is lost here, and this call's answer says so
            # (the client sends it itself).
            reason = f"{len(self._relays_here)} in-process hand-offs already wait"
            log.warning("dropped relayed step %d of %s: %s", onward.step, onward.session_id,
                        reason)  # fmt: skip
            return reason
        # Its own stream state: the claims are the ones this call was checked with.
        here = _StreamState(claims=stream.claims, signed=stream.signed)
        task = asyncio.get_running_loop().create_task(self._relayed_here(onward, here))
        self._relays_here.add(task)
        task.add_done_callback(self._relays_here.discard)
        return None

    async def _relayed_here(self, onward: stage_pb2.ForwardRequest, here: _StreamState) -> None:
        try:
            await self._relayed_one(onward, here)
        except Exception:  # nobody awaits this task: its failure must at least be seen
            log.exception("in-process relay of step %d failed", onward.step)

    def _decode_input(self, request: stage_pb2.ForwardRequest, shard: LoadedShard) -> np.ndarray:
        config = shard.config
        first = request.layers.start == 0
        if not request.HasField("input"):
            raise StageError(grpc.StatusCode.INVALID_ARGUMENT, "the request carries no input")
        limits = self.limits
        try:
            if first:
                array = codec.decode(
                    request.input,
                    allowed=codec.INT_DTYPES,
                    ndim=2,
                    max_elements=limits.max_batch * limits.max_tokens_per_request,
                    name="token ids",
                )
            else:
                array = codec.decode(
                    request.input,
                    allowed=codec.FLOAT_DTYPES,
                    ndim=3,
                    shape=(None, None, config.hidden_size),
                    max_elements=limits.max_batch
                    * limits.max_tokens_per_request
                    * config.hidden_size,
                    name="hidden states",
                )
        except codec.TensorError as err:
            code = grpc.StatusCode.INVALID_ARGUMENT
            if "exceed the limit" in str(err):
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
            raise StageError(code, f"{err} (layers start at {request.layers.start})") from err
        batch, tokens = array.shape[0], array.shape[1]
        if batch > limits.max_batch:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"batch {batch} is larger than this node accepts ({limits.max_batch})",
            )
        if first:
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= config.vocab_size:
                bad = low if low < 0 else high
                raise StageError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"token id {bad} is outside the vocabulary [0, {config.vocab_size})",
                )
        last = request.layers.end == shard.num_layers
        # With relay_to it is meant for the route's last hop (checked in _check_relay):
        # this hop computes every position and passes it on.
        if request.last_position_only and not last and not request.relay_to:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"last_position_only asks for logits, but layers [{request.layers.start}, "
                f"{request.layers.end}) end before the model's last layer "
                f"({shard.num_layers}); set it only on the hop that ends there (or on a "
                "call whose relay_to ends there)",
            )
        if last and request.last_position_only:
            # One position answers, however long the input.
            fits = batch * config.vocab_size * 4 <= limits.max_output_bytes
            per_request = limits.max_tokens_per_request if fits else 0
        else:
            width = config.vocab_size * 4 if last else config.hidden_size * shard.dtype.itemsize
            per_request = min(
                limits.max_tokens_per_request, limits.max_output_bytes // max(1, batch * width)
            )
        if tokens > per_request:
            raise StageError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{tokens} tokens in one request; this stage answers at most {per_request} "
                "per request (split the input into chunks with increasing start_pos)",
            )
        return array

    def _check_length(
        self,
        request: stage_pb2.ForwardRequest,
        claims: client_api_pb2.CapabilityClaims,
        shard: LoadedShard,
        batch: int,
        tokens: int,
    ) -> None:
        total = request.start_pos + tokens
        if total > claims.max_tokens:
            raise StageError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"positions up to {total} exceed the session's budget of {claims.max_tokens} "
                "tokens; open a session with a larger max_length",
            )
        max_positions = shard.config.max_position_embeddings
        if total > max_positions:
            raise StageError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"positions up to {total} exceed the model's context of {max_positions}",
            )
        if total * batch > shard.kv_tokens_budget:
            raise StageError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{total} positions x batch {batch} exceed this shard's KV cache budget of "
                f"{shard.kv_tokens_budget} tokens; use a shorter sequence or another replica",
            )

    def _cache_for(
        self,
        shard: LoadedShard,
        session_key: str,
        request: stage_pb2.ForwardRequest,
        claims: client_api_pb2.CapabilityClaims,
        batch: int,
        tokens: int,
    ) -> StageKVCache:
        start, end = request.layers.start, request.layers.end
        cache = shard.cache(session_key, start, end)
        if cache is not None and request.start_pos == 0 and cache.batch != batch:
            # Starting over with another batch size: the old cache cannot be reused.
            shard.release(session_key)
            cache = None
        if cache is None:
            if request.start_pos != 0:
                raise StageError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"this node holds no cache for session {request.session_id!r} on layers "
                    f"[{start}, {end}) (never opened here, ended, or expired after idling); "
                    f"start_pos must be 0, got {request.start_pos}: replay from the start",
                )
            self._admit_new_session(request.session_id)
            max_len = min(
                claims.max_tokens,
                shard.config.max_position_embeddings,
                shard.kv_tokens_budget // batch,
            )
            try:
                return shard.open_cache(session_key, start, end, max_len, batch)
            except CacheBudgetError as err:
                raise StageError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from err
        if cache.batch != batch:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the session's cache here was opened for batch {cache.batch}, the input has "
                f"batch {batch}",
            )
        if request.start_pos > cache.length:
            raise StageError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"start_pos {request.start_pos} would skip positions: this node's cache holds "
                f"{cache.length} tokens of the session; continue at {cache.length} or replay "
                "from 0",
            )
        if request.start_pos + tokens > cache.max_len:
            raise StageError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"positions up to {request.start_pos + tokens} do not fit the cache opened "
                f"for {cache.max_len} tokens",
            )
        return cache

    def _admit_new_session(self, session_id: str) -> None:
        already_here = any(
            session_of(key) == session_id
            for shard in self._shards.shards()
            for key in shard.session_keys()
        )
        if already_here:
            return
        if not self._ctx.accepting_work:
            raise StageError(
                grpc.StatusCode.UNAVAILABLE,
                "this node is draining: it finishes open sessions but takes no new ones",
            )
        cap = self._ctx.max_sessions
        if cap and self._shards.active_sessions() >= cap:
            raise StageError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this node already serves its owner's limit of {cap} sessions; use another "
                "replica",
            )

    async def _compute(
        self,
        shard: LoadedShard,
        start: int,
        end: int,
        array: np.ndarray,
        cache: StageKVCache,
        request: stage_pb2.ForwardRequest,
    ) -> tuple[common_pb2.Tensor, float, list[stage_pb2.ProbeAnswer]]:
        stage = shard.stage_for(start, end)
        start_pos = request.start_pos
        wire_dtype = request.input.dtype
        last_position_only = request.last_position_only and stage.is_last
        probes = list(request.probes)
        # The probed positions' logits and the last one's (the answer), in one head matmul.
        last = int(array.shape[1]) - 1
        rows = sorted({p.position for p in probes} | {last}) if probes else None

        def run() -> tuple[common_pb2.Tensor, float, list[stage_pb2.ProbeAnswer]]:
            began = time.perf_counter()
            x = _to_torch(array, wire_dtype)
            answers: list[stage_pb2.ProbeAnswer] = []
            with torch.inference_mode():
                out = stage.forward(
                    x,
                    cache,
                    start_pos,
                    last_position_only=last_position_only,
                    logit_positions=rows if rows != [last] else None,
                )
                if rows is not None:
                    if rows != [last]:
                        logits, out = out, out[:, -1:]
                    else:
                        logits = out
                    at = {position: i for i, position in enumerate(rows)}
                    answers = [_probe_answer(logits[0, at[p.position]], p) for p in probes]
            tensor = _to_wire(out, logits=stage.is_last)
            return tensor, (time.perf_counter() - began) * 1000.0, answers

        # Handing a decode step to the compute thread and back costs two thread wake-ups,
        # a real share of a hop's overhead. When that thread is idle and the stage's last
        # step was quick, the step runs right here instead; prefill chunks, replays and slow
        # stages still go to the thread so the event loop never stalls for long.
        view = (shard.key, start, end)
        limits = self.limits
        inline = (
            array.shape[0] * array.shape[1] <= limits.inline_max_tokens
            and self._step_ms.get(view, math.inf) <= limits.inline_max_ms
        )
        background = request.background
        try:
            tensor, compute_ms, answers = await self._shards.run(  # type: ignore[misc]
                run, inline_if_idle=inline and not background, background=background
            )
            if not background:  # a check's time on the slower thread says nothing of hops
                self._step_ms[view] = compute_ms
            return tensor, compute_ms, answers
        except CacheFullError as err:
            raise StageError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from err
        except ValueError as err:
            raise StageError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
        except Exception as err:
            log.exception("forward of %s on %s failed", request.session_id, shard.key)
            raise StageError(
                grpc.StatusCode.INTERNAL,
                f"the node failed to run layers [{start}, {end}): {type(err).__name__}: {err}",
            ) from err

    # ---- sessions -------------------------------------------------------------------

    def _lock_for(self, session_key: str) -> asyncio.Lock:
        lock = self._cache_locks.get(session_key)
        if lock is None:
            lock = self._cache_locks[session_key] = asyncio.Lock()
        return lock

    def _release_session(self, session_id: str) -> bool:
        released = False
        for shard in self._shards.shards():
            for key in shard.session_keys():
                if session_of(key) == session_id:
                    released = shard.release(key) or released
        for key in [k for k in self._input_chains if session_of(k) == session_id]:
            del self._input_chains[key]
        for key in [k for k in self._newest_step if session_of(k) == session_id]:
            del self._newest_step[key]
        return released

    def expire_idle(self) -> list[str]:
        """Free caches idle longer than the TTL; returns their session keys."""
        expired = self._shards.expire_idle()
        if expired:
            log.info("expired idle session caches: %s", ", ".join(expired))
        live_keys = {k for s in self._shards.shards() for k in s.session_keys()}
        for key in [k for k in self._input_chains if k not in live_keys]:
            del self._input_chains[key]
        for key in [k for k in self._newest_step if k not in live_keys]:
            del self._newest_step[key]
        # Subscriptions and links of sessions gone from here end with them (a subscription
        # not yet used gets the same idle time as a cache).
        live_sessions = {session_of(k) for k in live_keys}
        self._deliveries.sweep(live_sessions, self._shards.idle_ttl_s)
        self._relay.keep_only(live_sessions)
        held = {shard.key for shard in self._shards.shards()}
        for view in [v for v in self._step_ms if v[0] not in held]:
            del self._step_ms[view]  # a dropped shard's step times
        for key in list(self._cache_locks):
            if key not in live_keys and not self._cache_locks[key].locked():
                del self._cache_locks[key]
        return expired

    def _start_expiry(self) -> None:
        if self._expiry_task is None or self._expiry_task.done():
            self._expiry_task = asyncio.get_running_loop().create_task(self._expiry_loop())

    async def _expiry_loop(self) -> None:
        interval = min(self.limits.expiry_interval_s, self._shards.idle_ttl_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self.expire_idle()
            except Exception:  # the sweeper must survive whatever one shard does
                log.exception("idle session sweep failed")
            save_usage(self._usage)

    async def close(self) -> None:
        for task in list(self._relays_here):
            task.cancel()
        self._deliveries.close()
        await self._relay.close()
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
        save_usage(self._usage)
        await self._settler.close()


@dataclass
class _StepsSeen:
    step: int = 0  # the newest step any call of this cache ran with
    direct: int = 0  # the newest one the client sent itself (not relayed)


def _ring_params(ring: stage_pb2.RingContinuation) -> SamplingParams:
    return SamplingParams(temperature=ring.temperature, top_p=ring.top_p, seed=ring.seed)


def _granted(grants: Sequence[common_pb2.LayerRange], start: int, end: int) -> bool:
    """True when ``grants`` together cover [start, end) without a gap.

    A session may grant one node consecutive stages, e.g. [0, 4) and [4, 8); the client
    then runs them as one hop [0, 8) instead of two round trips to the same node.
    """
    covered = start
    for grant in sorted(grants, key=lambda g: g.start):
        if grant.start <= covered < grant.end:
            covered = grant.end
            if covered >= end:
                return True
    return False


def _check_probes(
    request: stage_pb2.ForwardRequest,
    shard: LoadedShard,
    batch: int,
    tokens: int,
    limits: StageLimits,
) -> None:
    """Probes read the logits of the model's last layer on this very call: a row each,
    computed if not sent, so no more of them than a full answer of logits may hold."""
    ends_model = request.layers.end == shard.num_layers
    if not ends_model or not request.last_position_only or request.relay_to or batch != 1:
        raise StageError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "probes read logits: set them only on a call of batch 1 whose layers end at the "
            f"model's last layer ({shard.num_layers}), with last_position_only and no "
            f"relay_to (got layers [{request.layers.start}, {request.layers.end}), batch "
            f"{batch}, last_position_only={request.last_position_only}, "
            f"{len(request.relay_to)} relay hop(s))",
        )
    vocab = shard.config.vocab_size
    most = max(1, limits.max_output_bytes // (4 * vocab))
    if len(request.probes) > most:
        raise StageError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{len(request.probes)} probes in one call; at a vocabulary of {vocab} this node "
            f"reads at most {most} rows of logits per call: split the input into shorter calls",
        )
    problem = logit_probes.positions_problem(request.probes, tokens, vocab)
    if problem is not None:
        raise StageError(grpc.StatusCode.INVALID_ARGUMENT, problem)


def _probe_answer(row: torch.Tensor, probe: stage_pb2.LogitProbe) -> stage_pb2.ProbeAnswer:
    """One probed position's logits (``row``: [vocab] on the compute device)."""
    row = row.float()
    top = torch.topk(row, min(logit_probes.TOP_K, row.shape[0]))
    probed = row[torch.tensor(list(probe.token_ids), dtype=torch.long, device=row.device)]
    return stage_pb2.ProbeAnswer(
        position=probe.position,
        top_ids=top.indices.tolist(),
        top_logits=top.values.tolist(),
        probed_logits=probed.tolist(),
        logsumexp=float(torch.logsumexp(row.double(), dim=0)),
    )


def _to_torch(array: np.ndarray, wire_dtype: str) -> torch.Tensor:
    # np.frombuffer views are read-only; torch wants memory it may own.
    if wire_dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    if wire_dtype in codec.INT_DTYPES:
        return torch.from_numpy(array.astype(np.int64))
    return torch.from_numpy(array.copy())


def _to_wire(out: torch.Tensor, *, logits: bool) -> common_pb2.Tensor:
    out = out.detach().to("cpu")
    if logits:
        return codec.encode(out.float().numpy(), "float32")
    if out.dtype == torch.bfloat16:
        return codec.encode(out.view(torch.int16).numpy().view(np.uint16), "bfloat16")
    name = {torch.float32: "float32", torch.float16: "float16"}[out.dtype]
    return codec.encode(out.numpy(), name)


def build_stage_servicer(ctx: AgentContext) -> StageServicer:
    """Plug-in entry point the agent calls before it registers (see node_agent/plugins.py)."""
    return StageServicer(ctx, shard_manager_for(ctx))
