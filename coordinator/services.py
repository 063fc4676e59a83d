"""The three gRPC services of the coordinator: Coordinator (nodes), ClientApi, Admin.

The registry's RPCs are answered here. RPCs of parts that are wired in separately
(model store, sessions) are delegated to `ctx.model_store` / `ctx.sessions`, calling the
method named after the RPC in snake_case with `(request_or_iterator, context)`; while that
part is missing the RPC answers UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from coordinator.admin_auth import require_admin
from coordinator.context import CoordinatorContext
from coordinator.node_state import NodeState
from coordinator.registry import AttachSession, RegistryError
from protos.tessera.v1 import (
    admin_pb2_grpc,
    client_api_pb2,
    client_api_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    ledger_pb2_grpc,
    verification_pb2_grpc,
)

log = logging.getLogger(__name__)

_MISSING = {
    "model_store": "this coordinator has no model store configured yet",
    "sessions": "this coordinator cannot open inference sessions yet (no session manager)",
    "ledger": "this coordinator keeps no credit ledger",
    "verifier": "this coordinator runs no verifier",
}


async def _component(ctx: CoordinatorContext, name: str, context: Any) -> Any:
    component = getattr(ctx, name)
    if component is None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, _MISSING[name])
    return component


async def _abort_with(context: Any, error: RegistryError) -> NoReturn:
    await context.abort(error.code, str(error))
    raise AssertionError("unreachable: abort() raises")


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, ctx: CoordinatorContext) -> None:
        self.ctx = ctx
        self.registry = ctx.registry

    async def GetChallenge(
        self, request: coordinator_pb2.ChallengeRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.Challenge:
        try:
            nonce, expires_ms = self.registry.issue_challenge(request.public_key)
        except RegistryError as exc:
            await _abort_with(context, exc)
        return coordinator_pb2.Challenge(nonce=nonce, expires_unix_ms=expires_ms)

    async def Register(
        self, request: coordinator_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterResponse:
        try:
            return await self.registry.register(request)
        except RegistryError as exc:
            log.info("refused a registration from %s: %s: %s", context.peer(), exc.code.name, exc)
            await _abort_with(context, exc)

    async def Attach(
        self,
        request_iterator: AsyncIterator[coordinator_pb2.NodeMessage],
        context: grpc.aio.ServicerContext,
    ) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the stream ended before hello")
        if first.WhichOneof("kind") != "hello":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first message on Attach must be hello{node_id, attach_ticket}, "
                f"got {first.WhichOneof('kind') or 'an empty message'}",
            )
        try:
            session = self.registry.open_attach(first.hello, context)
        except RegistryError as exc:
            await _abort_with(context, exc)
            return
        reason = "the stream broke"
        try:
            await session.send(self.registry.welcome(session))
            reason = await self._serve_stream(session, context)
        except RegistryError as exc:
            reason = f"bad message: {exc}"
            self.registry.close_attach(session, reason)
            await _abort_with(context, exc)
        except asyncio.CancelledError:
            if session.ended is None:  # the node went away; gRPC cancelled us
                self.registry.close_attach(session, "the stream broke")
                raise
            _uncancel()
            code, details = session.ended
            self.registry.close_attach(session, details)
            await context.abort(code, details)
        finally:
            self.registry.close_attach(session, reason)

    async def _serve_stream(self, session: AttachSession, context: grpc.aio.ServicerContext) -> str:
        registry = self.registry
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return "the node closed its stream"
            kind = message.WhichOneof("kind")
            if kind == "heartbeat":
                ack = registry.on_heartbeat(session, message.heartbeat)
                if ack is not None:
                    await session.send(ack)
            elif kind == "shard_status":
                registry.on_shard_status(session, message.shard_status)
            elif kind == "drain":
                registry.on_drain_request(session, message.drain)
            elif kind == "hello":
                raise RegistryError(
                    grpc.StatusCode.INVALID_ARGUMENT, "hello may be sent only once per stream"
                )
            else:
                raise RegistryError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "empty NodeMessage: set heartbeat, drain or shard_status",
                )

    async def GetManifest(self, request: common_pb2.ModelRef, context: Any) -> Any:
        store = await _component(self.ctx, "model_store", context)
        return await store.get_manifest(request, context)

    async def FetchTensors(self, request: Any, context: Any) -> AsyncIterator[Any]:
        store = await _component(self.ctx, "model_store", context)
        async for chunk in store.fetch_tensors(request, context):
            yield chunk


def _uncancel() -> None:
    # We cancelled this task ourselves to end the stream; clear the request so the awaits
    # that send the final status are not cancelled as well (Python >= 3.11).
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


class ClientApiService(client_api_pb2_grpc.ClientApiServicer):
    def __init__(self, ctx: CoordinatorContext) -> None:
        self.ctx = ctx

    async def ListNodes(
        self, request: client_api_pb2.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> client_api_pb2.ListNodesResponse:
        states = None if request.include_offline else set(NodeState) - {
            NodeState.OFFLINE, NodeState.BANNED
        }  # fmt: skip
        views = sorted(self.ctx.registry.nodes(states), key=lambda v: (v.name, v.node_id))
        nodes = [v.to_proto() for v in views]
        if self.ctx.verifier is not None:
            for info in nodes:
                info.trust.CopyFrom(self.ctx.verifier.trust(info.node_id))
        speed_of = getattr(self.ctx.planner, "speed", None)
        if speed_of is not None:  # claimed vs measured speed (coordinator/placement.py)
            for info in nodes:
                speed = speed_of(info.node_id)
                if speed is not None:
                    info.speed.CopyFrom(speed)
        reliability_of = getattr(self.ctx.planner, "reliability", None)
        if reliability_of is not None:  # how often it leaves (coordinator/reliability.py)
            for info in nodes:
                info.reliability.CopyFrom(reliability_of(info.node_id))
        return client_api_pb2.ListNodesResponse(nodes=nodes)

    async def ListModels(self, request: Any, context: Any) -> Any:
        store = await _component(self.ctx, "model_store", context)
        return await store.list_models(request, context)

    async def GetModel(self, request: Any, context: Any) -> Any:
        store = await _component(self.ctx, "model_store", context)
        return await store.get_model(request, context)

    async def OpenSession(self, request: Any, context: Any) -> Any:
        sessions = await _component(self.ctx, "sessions", context)
        return await sessions.open_session(request, context)

    async def Reroute(self, request: Any, context: Any) -> Any:
        sessions = await _component(self.ctx, "sessions", context)
        return await sessions.reroute(request, context)

    async def CloseSession(self, request: Any, context: Any) -> Any:
        sessions = await _component(self.ctx, "sessions", context)
        return await sessions.close_session(request, context)

    async def ReportStepTimes(self, request: Any, context: Any) -> Any:
        sessions = await _component(self.ctx, "sessions", context)
        return await sessions.report_step_times(request, context)


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, ctx: CoordinatorContext) -> None:
        self.ctx = ctx

    async def _as_admin(self, context: grpc.aio.ServicerContext, action: Callable[[], Any]) -> Any:
        """``action()``'s result (awaited if need be) for a caller with the admin token."""
        await require_admin(context, self.ctx.admin_token)
        try:
            result = action()
            return await result if inspect.isawaitable(result) else result
        except RegistryError as exc:
            await _abort_with(context, exc)

    async def DrainNode(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        registry = self.ctx.registry
        reason = await self._as_admin(
            context, lambda: registry.drain(request.node_id, request.reason)
        )
        # %r: an admin's free text must not forge log lines.
        log.info("admin drained node %s (%r)", request.node_id, reason)
        return common_pb2.Empty()

    # The registry logs and records the state changes of these two, with their reasons.
    async def BanNode(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        registry = self.ctx.registry
        await self._as_admin(
            context, lambda: registry.operator_ban(request.node_id, request.reason)
        )
        return common_pb2.Empty()

    async def UnbanNode(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        registry = self.ctx.registry
        await self._as_admin(context, lambda: registry.unban(request.node_id, request.reason))
        return common_pb2.Empty()

    async def AddModel(self, request_iterator: Any, context: Any) -> Any:
        await require_admin(context, self.ctx.admin_token)
        store = await _component(self.ctx, "model_store", context)
        return await store.add_model(request_iterator, context)

    async def RemoveModel(self, request: Any, context: Any) -> Any:
        await require_admin(context, self.ctx.admin_token)
        store = await _component(self.ctx, "model_store", context)
        return await store.remove_model(request, context)


class LedgerService(ledger_pb2_grpc.LedgerServicer):
    def __init__(self, ctx: CoordinatorContext) -> None:
        self.ctx = ctx

    async def GrantCredits(self, request: Any, context: Any) -> Any:
        await require_admin(context, self.ctx.admin_token)
        ledger = await _component(self.ctx, "ledger", context)
        return await ledger.grant_credits(request, context)

    async def GetBalance(self, request: Any, context: Any) -> Any:
        ledger = await _component(self.ctx, "ledger", context)
        return await ledger.get_balance(request, context)

    async def GetEarnings(self, request: Any, context: Any) -> Any:
        ledger = await _component(self.ctx, "ledger", context)
        return await ledger.get_earnings(request, context)

    async def Audit(self, request: Any, context: Any) -> Any:
        await require_admin(context, self.ctx.admin_token)
        ledger = await _component(self.ctx, "ledger", context)
        return await ledger.audit(request, context)

    async def DepositStake(self, request: Any, context: Any) -> Any:
        ledger = await _component(self.ctx, "ledger", context)
        return await ledger.deposit_stake(request, context)

    async def SettleUsage(self, request: Any, context: Any) -> Any:
        ledger = await _component(self.ctx, "ledger", context)
        return await ledger.settle_usage(request, context)


class VerificationService(verification_pb2_grpc.VerificationServicer):
    """Delegates to the verifier component (coordinator/verifier)."""

    def __init__(self, ctx: CoordinatorContext) -> None:
        self.ctx = ctx

    async def Report(self, request: Any, context: Any) -> Any:  # noqa: N802
        verifier = await _component(self.ctx, "verifier", context)
        return await verifier.report(request, context)

    async def GetSessionRisk(self, request: Any, context: Any) -> Any:  # noqa: N802
        verifier = await _component(self.ctx, "verifier", context)
        return await verifier.get_session_risk(request, context)

    async def ReportTrainingDispute(self, request: Any, context: Any) -> Any:  # noqa: N802
        verifier = await _component(self.ctx, "verifier", context)
        return await verifier.report_training_dispute(request, context)

    async def ReportTrainingChecks(self, request: Any, context: Any) -> Any:  # noqa: N802
        verifier = await _component(self.ctx, "verifier", context)
        return await verifier.report_training_checks(request, context)
