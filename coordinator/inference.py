"""Wires inference into a running coordinator: registry and model store events drive
placement; placement's readiness feeds sessions; the ClientApi session RPCs land here.

`build(ctx)` is called by the server at start-up. It sets `ctx.planner` (placement, which
the model store asks for coverage) and returns the session RPC handler (`ctx.sessions`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import grpc

from coordinator.context import CoordinatorContext
from coordinator.node_state import NodeState
from coordinator.placement import Placement, PlacementNode, model_spec
from coordinator.plan_store import PlanStore
from coordinator.refusal import Refusal
from coordinator.registry import (
    NodeStateChanged,
    NodeView,
    ShardStatusReported,
    TelemetryReported,
)
from coordinator.reliability import HISTORY_EVENTS
from coordinator.sessions import Sessions
from protos.tessera.v1 import client_api_pb2, coordinator_pb2

log = logging.getLogger("tessera.inference")

# Nodes in these states hold no routable shards.
_GONE = frozenset({NodeState.OFFLINE, NodeState.DRAINING, NodeState.BANNED})
# Dials of unreachable nodes in flight at once.
RECHECK_DIALS = 32
# A node that drivers report they cannot connect to is dialed back at most this often.
REDIAL_MIN_S = 10.0


class SessionRpc:
    """The ClientApi session RPCs, in the server's delegate convention."""

    def __init__(self, ctx: CoordinatorContext, placement: Placement) -> None:
        self._ctx = ctx
        self._placement = placement
        self._tasks: set[asyncio.Task[Any]] = set()
        # Online nodes placement does not get: their data address was not reachable.
        self._unreachable: set[str] = set()
        # When a driver's report last made this coordinator dial a node (monotonic s).
        self._redialed: dict[str, float] = {}
        # Nodes the relay carries, and the address it gave each.
        self._relayed: dict[str, str] = {}
        store = ctx.model_store
        self.sessions = Sessions(
            ctx.signing_key,
            placement,
            model_info=self._model_info,
            model_names=lambda: [m.name for m in store.models()] if store else [],
            billing=ctx.ledger.billing if ctx.ledger is not None else None,
            usage_credit=ctx.settings.usage_credit_tokens,
            hop_details=self._hop_details,
            on_unreachable=self._doubt_reachability,
        )
        # The planner's reliability input: every node's departures and time online, from
        # the state changes in the database, then as they happen.
        placement.history.replay(ctx.registry.repo.events(limit=HISTORY_EVENTS))
        ledger = ctx.ledger
        if ledger is not None:
            placement.price_of = lambda node_id: float(ledger.price_of(node_id).price)
        ctx.registry.add_listener(self._on_registry_event)
        if store is not None:
            store.add_listener(lambda event, name: self._refresh_models())

    def _hop_details(self, hop: client_api_pb2.Hop) -> None:
        if self._ctx.verifier is not None:
            self._ctx.verifier.describe_hop(hop)

    def _model_info(self, name: str) -> client_api_pb2.ModelInfo | None:
        store = self._ctx.model_store
        record = store.model(name) if store is not None else None
        if record is None:
            return None
        return client_api_pb2.ModelInfo(
            name=record.name,
            num_layers=record.num_layers,
            hidden_size=record.hidden_size,
            vocab_size=record.vocab_size,
            max_positions=record.max_positions,
        )

    async def start(self) -> None:
        # Whom the saved plans place, too: the registry's record of who was connected falls
        # short after a coordinator was killed while its nodes were still coming back.
        registry = self._ctx.registry
        expected = {*registry.returning, *self._placement.planned_nodes()}
        returning = [
            node_id
            for node_id in sorted(expected)
            if (view := registry.node(node_id)) is not None and view.state is not NodeState.BANNED
        ]
        self._placement.await_returning(returning, self._ctx.settings.reattach_grace_s)
        self._refresh_models()
        for view in self._ctx.registry.nodes([NodeState.ONLINE]):
            self._node_up(view)
        self._spawn(self._recheck_unreachable())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    def _spawn(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _node_up(self, view: NodeView) -> None:
        """Place an online node by the address clients can use: its own, or the relay's
        while the coordinator cannot dial it back (a node behind NAT, a closed port, a wrong
        --advertise). With neither, it leaves placement until a later dial
        (``_recheck_unreachable``) reaches it: the one place that decides this."""
        if view.data_address and not view.reachable:
            relayed = self._relayed.get(view.node_id)
            if view.node_id not in self._unreachable and relayed is None:
                settings = self._ctx.settings
                log.warning(
                    "node %s advertises %s, which this coordinator could not dial back: "
                    "clients could not reach it either, so it gets no shards%s (dialed again "
                    "every %.0f s; its operator can open that port, or pass --advertise with "
                    "an address others can reach)",
                    view.node_id, view.data_address,
                    " until it opens a tunnel to the relay" if settings.relay_host else "",
                    settings.reachability_recheck_s,
                )  # fmt: skip
            self._unreachable.add(view.node_id)
            if relayed is not None:
                self._placement.node_up(PlacementNode(view.node_id, relayed, view.capabilities))
            else:
                self._placement.node_down(view.node_id)  # if it was placed by another address
                if self._ctx.settings.relay_host:  # it may have been reachable at registration
                    self._tell_reachability(view.node_id, reachable=False)
            return
        self._unreachable.discard(view.node_id)
        self._placement.node_up(PlacementNode(view.node_id, view.data_address, view.capabilities))
        if view.node_id in self._relayed:  # reachable again: its tunnel is of no more use
            self._tell_reachability(view.node_id, reachable=True)

    def _tell_reachability(self, node_id: str, *, reachable: bool) -> None:
        """Tell the node what dialing it back found (its agent opens or closes its relay
        tunnel); a node that is not attached learns it when it registers again."""
        command = coordinator_pb2.Command(
            reachability=coordinator_pb2.Reachability(reachable=reachable)
        )
        self._spawn(self._ctx.registry.send_command(node_id, command))

    def relayed(self, node_id: str, address: str) -> None:
        """The relay carries this node's data plane at ``address`` (coordinator/nat_relay.py):
        placement gets it with that address while it cannot be dialed directly."""
        self._relayed[node_id] = address
        view = self._ctx.registry.node(node_id)
        if view is not None and view.state is NodeState.ONLINE:
            self._node_up(view)

    def unrelayed(self, node_id: str) -> None:
        if self._relayed.pop(node_id, None) is None:
            return
        view = self._ctx.registry.node(node_id)
        if view is not None and view.state is NodeState.ONLINE:
            self._node_up(view)

    def _doubt_reachability(self, node_ids: list[str]) -> None:
        """Drivers could not connect to these nodes: dial each back (at most every
        REDIAL_MIN_S; a driver's word alone moves nothing), and take one that does not
        answer out of placement until it does (``_recheck_unreachable``)."""
        now = time.monotonic()
        for node_id in node_ids:
            if node_id in self._unreachable or now - self._redialed.get(node_id, -1e9) < (
                REDIAL_MIN_S
            ):
                continue
            self._redialed[node_id] = now
            self._spawn(self._redial(node_id))

    async def _redial(self, node_id: str) -> None:
        if node_id not in self._unreachable:
            await self._dial_back(node_id, again=True)

    async def _dial_back(self, node_id: str, *, again: bool = False) -> None:
        """Dial an online node back (``again``: even one counted reachable) and, when the
        answer changed, place it as ``_node_up`` says."""
        registry = self._ctx.registry
        view = registry.node(node_id)
        if view is None or view.state is not NodeState.ONLINE:
            self._unreachable.discard(node_id)
            return
        if await registry.recheck_reachability(node_id, again=again) == view.reachable:
            return
        fresh = registry.node(node_id)
        if fresh is not None and fresh.state is NodeState.ONLINE:
            if fresh.reachable:
                log.info("node %s answers at %s now: it may get shards", node_id,
                         fresh.data_address)  # fmt: skip
            self._node_up(fresh)

    async def _recheck_unreachable(self) -> None:
        # Each dial may wait out its timeout: many unreachable nodes are dialed side by side.
        dialing = asyncio.Semaphore(RECHECK_DIALS)

        async def recheck(node_id: str) -> None:
            async with dialing:
                await self._dial_back(node_id)

        while True:
            await asyncio.sleep(self._ctx.settings.reachability_recheck_s)
            await asyncio.gather(*(recheck(n) for n in sorted(self._unreachable)))

    def _refresh_models(self) -> None:
        store = self._ctx.model_store
        if store is None:
            return
        specs = []
        for record in store.models():
            try:
                specs.append(model_spec(record.name, record.config_json))
            except ValueError as exc:  # imported before a layout rule tightened
                log.error("cannot place model %s: %s", record.name, exc)
        self._placement.set_models(specs)

    def _on_registry_event(self, event: object) -> None:
        if isinstance(event, NodeStateChanged):
            self._placement.history.observe(
                event.node_id, event.new.value, event.ts_ms, event.reason
            )
            if event.new is NodeState.ONLINE:
                view = self._ctx.registry.node(event.node_id)
                if view is not None:
                    self._node_up(view)
            elif event.new in _GONE:
                self._unreachable.discard(event.node_id)
                self._placement.node_down(event.node_id)
        elif isinstance(event, ShardStatusReported):
            self._spawn(self._placement.shard_status(event.node_id, event.status))
        elif isinstance(event, TelemetryReported):
            self._placement.node_reported(event.node_id)
            t = event.telemetry
            self._placement.update_load(event.node_id, float(t.active_sessions + t.queue_length))
            if t.rtt_ms:
                self._placement.observe_rtts(event.node_id, t.rtt_ms)

    # ---- RPCs -------------------------------------------------------------------------------

    async def open_session(
        self, request: client_api_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> client_api_pb2.SessionGrant:
        return await self._answer(context, self.sessions.open_session, request)

    async def reroute(
        self, request: client_api_pb2.RerouteRequest, context: grpc.aio.ServicerContext
    ) -> client_api_pb2.RerouteResponse:
        return await self._answer(context, self.sessions.reroute, request)

    async def close_session(
        self, request: client_api_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> client_api_pb2.CloseSessionResponse:
        return await self._answer(context, self.sessions.close_session, request)

    async def report_step_times(
        self, request: client_api_pb2.StepTimesReport, context: grpc.aio.ServicerContext
    ) -> client_api_pb2.StepTimesAck:
        return await self._answer(context, self.sessions.report_step_times, request)

    @staticmethod
    async def _answer(context: grpc.aio.ServicerContext, method: Any, request: Any) -> Any:
        try:
            return method(request)
        except Refusal as exc:  # SessionError, LedgerError
            await context.abort(exc.code, exc.message, trailing_metadata=exc.trailing_metadata)


def build(ctx: CoordinatorContext) -> SessionRpc:
    settings = ctx.settings
    plans = PlanStore(ctx.db)
    placement = Placement(
        ctx.registry.send_command,
        replicas=settings.replicas,
        min_stages=settings.min_stages,
        kv_tokens=settings.kv_tokens_per_shard,
        max_token_latency_s=settings.max_token_latency_ms / 1000.0,
        max_token_price=settings.max_token_price_units,
        on_plans=plans.save,
    )
    # A restarted coordinator starts from its last plans, and the measurements they were
    # made with: shards stay where they are.
    placement.restore(plans.load())
    plans.load_measurements(placement.measurements)
    ctx.planner = placement
    return SessionRpc(ctx, placement)
