"""Sessions: routes plus capability tokens that stage nodes verify offline.

The coordinator keeps no per-session state that a restart could lose: a Reroute or
CloseSession is authorised by the capability the coordinator itself signed, so a client
whose session began before a coordinator restart can still fail over after it.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.operators import same_operator
from coordinator.placement import Placement
from coordinator.refusal import Refusal
from coordinator.router import Holder, Hop, NoRouteError, Stage, cover_span, route
from protos import identity
from protos.quoting import shown
from protos.tessera.v1 import client_api_pb2, common_pb2

log = logging.getLogger("tessera.sessions")

MAX_SESSION_TOKENS = 1 << 20
MAX_STEP_TIMES = 256  # entries per ReportStepTimes (drivers batch every few tokens)
MAX_STEP_WALL_MS = 600_000.0  # a stage call slower than this is a hang, not a speed
# Sessions whose accepted step reports are counted (a client may report each granted node
# at most max_tokens times per session); the oldest are forgotten first.
MAX_COUNTED_SESSIONS = 10_000
TOKEN_TTL_S = 3600.0
_MAX_NAME = 256
# Verification-only replicas granted per stage: enough that one unfit or same-operator
# replica still leaves a checker, few enough that the capability stays small.
MAX_CHECKERS = 3


class SessionError(Refusal):
    """A session request refused, with the gRPC status its caller gets."""


class Sessions:
    def __init__(
        self,
        signing_key: Ed25519PrivateKey,
        placement: Placement,
        model_info: Callable[[str], client_api_pb2.ModelInfo | None],
        model_names: Callable[[], list[str]],
        *,
        token_ttl_s: float = TOKEN_TTL_S,
        billing: Any = None,
        usage_credit: int = 0,
        hop_details: Callable[[client_api_pb2.Hop], None] | None = None,
        on_unreachable: Callable[[list[str]], None] | None = None,
    ) -> None:
        # Fills in what a driver needs to verify a hop's node (key, account, dtype, check
        # probability); the verifier provides it.
        self._hop_details = hop_details
        # Told the granted nodes a driver could not connect to (it dials them back itself).
        self._on_unreachable = on_unreachable
        self._key = signing_key
        self._public = identity.public_key_bytes(signing_key)
        self._placement = placement
        self._model_info = model_info
        self._model_names = model_names
        self._ttl_ms = int(token_ttl_s * 1000)
        # The ledger component (coordinator/ledger/service.py): quotes and escrows at open,
        # settles at close. None: every session is free.
        self._billing = billing
        # A paid session's credit at each node (CapabilityClaims.usage_credit).
        self._usage_credit = usage_credit
        # session id -> step reports accepted per node (bounds what one session can report)
        self._reported: OrderedDict[str, Counter[str]] = OrderedDict()

    # ---- RPCs (the server maps SessionError to a gRPC status) -----------------------------

    def open_session(
        self, request: client_api_pb2.OpenSessionRequest
    ) -> client_api_pb2.SessionGrant:
        info = self._known_model(request.model)
        if not 1 <= request.max_length <= MAX_SESSION_TOKENS:
            raise SessionError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_length must be between 1 and {MAX_SESSION_TOKENS}, got {request.max_length}",
            )
        if info.max_positions and request.max_length > info.max_positions:
            # Past its positions a model has no RoPE table and no cache room: every node
            # would refuse the step that crosses it, mid-generation.
            raise SessionError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model {info.name!r} holds at most {info.max_positions} positions (prompt and "
                f"generated tokens together), and {request.max_length} were asked for: "
                "generate fewer new tokens, or shorten the prompt",
            )
        if request.max_length > self._placement.kv_tokens:
            # Every shard is assigned this much cache: a longer session would be refused by
            # every replica at the position that crosses it, mid-generation.
            raise SessionError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this swarm's nodes keep at most {self._placement.kv_tokens} tokens of cache "
                f"per session, and {request.max_length} were asked for: generate fewer new "
                "tokens, or shorten the prompt (the coordinator's operator sets it with "
                "`serve --kv-tokens`)",
            )
        if len(request.account) > _MAX_NAME:
            raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, "account name is too long")
        self._placement.note_session(info.name)
        boundaries = self._placement.boundaries(info.name)
        holders = self._placement.ready_holders(info.name)
        if not boundaries or not holders:
            raise SessionError(
                grpc.StatusCode.UNAVAILABLE,
                f"model {info.name!r} is not served yet: no node has finished loading it "
                "(nodes may still be fetching weights; try again shortly)",
            )
        try:
            if self._billing is None:
                stages, amount = route(boundaries, holders, rtt_ms=self._placement.rtt_ms), 0
            else:
                stages, amount = self._billing.plan(
                    boundaries, holders, request, rtt_ms=self._placement.rtt_ms
                )
        except NoRouteError as e:
            raise SessionError(
                grpc.StatusCode.UNAVAILABLE, f"model {info.name!r} is unavailable: {e}"
            ) from None
        session_id = "s" + secrets.token_hex(12)
        routed = [
            client_api_pb2.RouteStage(
                layers=_range(s.start, s.end),
                primary=self._hop(s.primary),
                alternates=[self._hop(a) for a in s.alternates],
                checkers=self._checkers(s, holders),
            )
            for s in stages
        ]
        grants = [h for s in routed for h in (s.primary, *s.alternates, *s.checkers)]
        claims = self._claims(session_id, info.name, request.max_length, request.account, grants)
        quote = None
        if self._billing is not None:
            quote = self._billing.open(
                session_id, request, stages, amount, claims.expires_unix_ms,
                checkers=[c.node_id for s in routed for c in s.checkers],
            )  # fmt: skip
            claims.account = quote.account
            if quote.amount > 0 and self._usage_credit > 0:
                # The nodes hold the client to acknowledging their receipts as it goes.
                claims.client_public_key = request.client_public_key
                claims.usage_credit = self._usage_credit
        log.info(
            "session %s for %s: %s",
            session_id,
            info.name,
            " -> ".join(f"{s.primary.node_id}[{s.start},{s.end})" for s in stages),
        )
        return client_api_pb2.SessionGrant(
            session_id=session_id,
            stages=routed,
            capability=identity.sign_capability(self._key, claims),
            num_layers=info.num_layers,
            hidden_size=info.hidden_size,
            vocab_size=info.vocab_size,
            quote=quote,
        )

    def reroute(self, request: client_api_pb2.RerouteRequest) -> client_api_pb2.RerouteResponse:
        claims = self._verified(request.session_id, request.capability)
        info = self._known_model(claims.model)
        span = request.span
        if not 0 <= span.start < span.end <= info.num_layers:
            raise SessionError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"span [{span.start}, {span.end}) is not within the model's "
                f"{info.num_layers} layers",
            )
        exclude = set(request.exclude_node_ids)
        try:
            hops = cover_span(
                span.start,
                span.end,
                self._placement.ready_holders(info.name),
                exclude,
                rtt_ms=self._placement.rtt_ms,
            )
        except NoRouteError as e:
            raise SessionError(grpc.StatusCode.UNAVAILABLE, f"cannot reroute: {e}") from None
        log.info(
            "session %s rerouted layers [%d, %d) away from %s (%s): %s",
            claims.session_id,
            span.start,
            span.end,
            # A client's own words and ids: quoted and cut, so they cannot flood or forge
            # log lines.
            shown(",".join(sorted(exclude)), 200) if exclude else "-",
            shown(request.reason) if request.reason else "no reason",
            " -> ".join(f"{h.node_id}[{h.start},{h.end})" for h in hops),
        )
        grants = [g for g in claims.grants if g.node_id not in exclude]
        new_grants = [self._hop(h) for h in hops]
        renewed = self._claims(
            claims.session_id,
            claims.model,
            claims.max_tokens,
            claims.account,
            [*grants, *new_grants],
        )
        renewed.client_public_key, renewed.usage_credit = (
            claims.client_public_key,
            claims.usage_credit,
        )
        claims = renewed
        if self._billing is not None:
            self._billing.rerouted(
                claims.session_id, [h.node_id for h in hops], claims.expires_unix_ms
            )
        return client_api_pb2.RerouteResponse(
            hops=new_grants, capability=identity.sign_capability(self._key, claims)
        )

    def close_session(
        self, request: client_api_pb2.CloseSessionRequest
    ) -> client_api_pb2.CloseSessionResponse:
        claims = self._verified(request.session_id, request.capability)
        response = client_api_pb2.CloseSessionResponse()
        if self._billing is not None:
            settlement = self._billing.close(claims.session_id, request.usage)
            if settlement is not None:
                response.settlement.CopyFrom(settlement)
        log.info("session %s closed", claims.session_id)
        return response

    def report_step_times(
        self, request: client_api_pb2.StepTimesReport
    ) -> client_api_pb2.StepTimesAck:
        """A driver's timings of its stage calls: the measured speed of the nodes it used.

        Only the session holder can report (its capability), only about nodes and layers
        its capability grants, and at most `max_tokens` calls per node per session, so one
        client cannot drown a node's average; each sample moves an established average by
        at most 4x (coordinator/measurements.py). Any bad entry refuses the whole report.
        """
        claims = self._verified(request.session_id, request.capability)
        if len(request.steps) > MAX_STEP_TIMES:
            raise SessionError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(request.steps)} step times in one report; send at most {MAX_STEP_TIMES} "
                "per call (batch every few tokens)",
            )
        granted: dict[str, list[tuple[int, int]]] = {}
        for grant in claims.grants:
            granted.setdefault(grant.node_id, []).append((grant.layers.start, grant.layers.end))
        for i, step in enumerate(request.steps):
            _check_step(i, step, granted, claims.max_tokens)
        unreachable = list(request.unreachable_node_ids)
        if len(unreachable) > len(granted):
            raise SessionError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(unreachable)} unreachable nodes reported for a session of "
                f"{len(granted)} nodes",
            )
        for node_id in unreachable:
            if node_id not in granted:
                raise SessionError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"unreachable_node_ids names {shown(node_id)}, which this session's "
                    "capability does not grant",
                )
        counted = self._reported.setdefault(claims.session_id, Counter())
        self._reported.move_to_end(claims.session_id)
        while len(self._reported) > MAX_COUNTED_SESSIONS:
            self._reported.popitem(last=False)
        per_node = Counter(step.node_id for step in request.steps)
        over = [n for n, k in per_node.items() if counted[n] + k > claims.max_tokens]
        if over:
            raise SessionError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this session already reported {claims.max_tokens} calls to node {over[0]} "
                "(its token budget); later reports are not needed",
            )
        accepted = 0
        for step in request.steps:
            layers = step.layers.end - step.layers.start
            if self._placement.observe_step(
                step.node_id, claims.model, layers, step.tokens, step.wall_ms
            ):
                counted[step.node_id] += 1
                accepted += 1
        if unreachable and self._on_unreachable is not None:
            self._on_unreachable(sorted(set(unreachable)))
        return client_api_pb2.StepTimesAck(accepted=accepted)

    # ---- helpers ----------------------------------------------------------------------------

    def _hop(self, hop: Hop) -> client_api_pb2.Hop:
        message = _hop(hop)
        if self._hop_details is not None:
            self._hop_details(message)
        return message

    def _checkers(self, stage: Stage, holders: Sequence[Holder]) -> list[client_api_pb2.Hop]:
        """Ready replicas of the stage's layers that the billed route left out of its
        alternates (dearer than a cheap primary, or past the alternates' cap), of another
        operator than the primary's. Checks must not depend on what the client pays for:
        otherwise a cheap-preferring client, or the cheapest node, escapes them."""
        if self._hop_details is None:
            return []  # no verifier: nobody would check anything
        primary = self._hop(stage.primary)
        seen = {stage.primary.node_id, *(a.node_id for a in stage.alternates)}
        spare = sorted(
            (h for h in holders if h.start <= stage.start and stage.end <= h.end),
            key=lambda h: (h.cost(stage.end - stage.start), h.node_id),
        )
        checkers: list[client_api_pb2.Hop] = []
        for holder in spare:
            if holder.node_id in seen or len(checkers) == MAX_CHECKERS:
                continue
            seen.add(holder.node_id)
            hop = self._hop(Hop(holder.node_id, holder.address, stage.start, stage.end))
            if same_operator(primary.account, hop.account):
                continue  # one operator's nodes never check each other
            checkers.append(hop)
        return checkers

    def _known_model(self, name: str) -> client_api_pb2.ModelInfo:
        if not name or len(name) > _MAX_NAME:
            raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, "give a model name")
        info = self._model_info(name)
        if info is None:
            known = ", ".join(sorted(self._model_names())) or "none yet"
            raise SessionError(
                grpc.StatusCode.NOT_FOUND, f"unknown model {name!r}; known models: {known}"
            )
        return info

    def _verified(
        self, session_id: str, signed: client_api_pb2.SignedCapability
    ) -> client_api_pb2.CapabilityClaims:
        claims = identity.open_capability(self._public, signed)
        if claims is None:
            raise SessionError(
                grpc.StatusCode.UNAUTHENTICATED, "the capability was not signed by this coordinator"
            )
        if claims.session_id != session_id:
            raise SessionError(
                grpc.StatusCode.PERMISSION_DENIED, "the capability belongs to another session"
            )
        if claims.expires_unix_ms < time.time() * 1000:
            raise SessionError(
                grpc.StatusCode.UNAUTHENTICATED, "the session's capability expired; open a new one"
            )
        return claims

    def _claims(
        self,
        session_id: str,
        model: str,
        max_tokens: int,
        account: str,
        grants: list[client_api_pb2.Hop],
    ) -> client_api_pb2.CapabilityClaims:
        now = int(time.time() * 1000)
        return client_api_pb2.CapabilityClaims(
            session_id=session_id,
            model=model,
            grants=grants,
            issued_unix_ms=now,
            expires_unix_ms=now + self._ttl_ms,
            max_tokens=max_tokens,
            account=account,
        )


def _check_step(
    index: int,
    step: client_api_pb2.StepTime,
    granted: dict[str, list[tuple[int, int]]],
    max_tokens: int,
) -> None:
    spans = granted.get(step.node_id)
    if spans is None:
        raise SessionError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"step {index}: node {step.node_id[:64]!r} is not in this session's route; report "
            "only nodes the session's capability grants",
        )
    a, b = step.layers.start, step.layers.end
    if not any(start <= a < b <= end for start, end in spans):
        raise SessionError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"step {index}: layers [{a}, {b}) are not granted to node {step.node_id}",
        )
    if not 1 <= step.tokens <= max_tokens:
        raise SessionError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"step {index}: tokens must be between 1 and the session's {max_tokens}, "
            f"got {step.tokens}",
        )
    if not (math.isfinite(step.wall_ms) and 0.0 < step.wall_ms <= MAX_STEP_WALL_MS):
        raise SessionError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"step {index}: wall_ms must be a time in (0, {MAX_STEP_WALL_MS:.0f}] ms, "
            f"got {step.wall_ms}",
        )


def _range(start: int, end: int) -> common_pb2.LayerRange:
    return common_pb2.LayerRange(start=start, end=end)


def _hop(hop: Hop) -> client_api_pb2.Hop:
    return client_api_pb2.Hop(
        node_id=hop.node_id, address=hop.address, layers=_range(hop.start, hop.end)
    )
